# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Token routing: all-to-all dispatch or token replication?
#
# Under expert parallelism a token's `k` experts live on other devices, so either the token goes to them or the
# experts' devices get every token. **All-to-all dispatch** (the `dp_ep` stage, notebook 02) sends each token
# once to every device that owns one of its `k` experts and brings one partial output per device back; it has to
# reserve buffer room for an uneven routing, or drop what does not fit. **Token replication** (the `replicate`
# stage) all-gathers every token (and its top-k ids and weights) to every device, runs the local experts on the
# copies routed to them, and reduce-scatters the summed outputs back. This notebook asks, for Qwen3.5-397B (top-10
# of 512 experts on 8 devices): which moves fewer bytes, which loads the ring's links less and waits less, what
# static shapes and dropping cost, and which gives a request an answer that does not depend on who else is in
# the batch.

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/03_token_routing.ipynb)

# %%
import importlib.util, os, subprocess, sys  # noqa: E401, I001 (one line: the setup stays short)

sys.path.append(os.path.dirname(os.getcwd()))  # from a checkout's notebooks/ folder: its library, not installed
REPO = os.environ.get("QWEN35_REPO") or "qwen35-playbook/qwen35-playbook"  # a fork: set $QWEN35_REPO
if importlib.util.find_spec("qwen35_lib") is None:  # Colab: pip-install it from GitHub (elsewhere: nothing happens)
    pip = subprocess.run(f"{sys.executable} -m pip install -q 'qwen35-playbook[reference] @ git+https://github.com/{REPO}'",
                         shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if pip.returncode:  # pip's exit status, and its last lines: why it failed
        raise RuntimeError(f"pip failed ({pip.returncode}):\n" + "\n".join(pip.stdout.splitlines()[-20:]))

# %%
from qwen35_lib import notebook  # what runs where: notebook.setup's docstring

devices, SIZE, mesh = notebook.setup()

# %% [markdown]
# ## 0. What replication buys (the cost model, TPU7x-8)
#
# **Compute.** The `replicate` stage against `dp_ep` (notebook 02): the same layout, the same experts, only the
# routing changes. Milliseconds per 1,000 tokens served by component, both workloads at 512 concurrent requests.

# %%
from qwen35_lib.stage_gain import gain_table, stage_gain

stages = {"replicate": stage_gain("replicate")}
print(gain_table(stages["replicate"]))

# %% [markdown]
# **Check.** The whole gain is in the collectives: attention, GDN and the experts' work are the same under both
# routings. Section 1 shows what each collective moves, device by device; section 2 says where the gain comes
# from.

# %%
for wl in ("8k/1k", "1k/8k"):
    change = stages["replicate"][wl]["component_change"]
    assert all(abs(change[g]) < 1e-9 for g in ("attention", "gdn", "moe")), (wl, change)
    assert change["collectives"] < 0 and stages["replicate"][wl]["gain"] > 1, (wl, change)
r = {wl: stages["replicate"][wl] for wl in ("8k/1k", "1k/8k")}
notebook.claim_greater("prefill_gains_more", "the prefill-heavy workload gains more, {prefill:.2%} against "
                       "{decode:.2%}: its steps are large, and there the collectives move bytes", prefill=r["8k/1k"][
                           "change"], decode=r["1k/8k"]["change"])
notebook.claim_largest("moe_dominates_decode", "on 1k/8k the time per token is the MoE's above all ({moe:.0f} ms "
                       "per 1,000 tokens, attention {attention:.0f}, collectives {collectives:.1f}), and routing does "
                       "not change it", r["1k/8k"]["ms_per_1k_tokens"], "moe")

# %% [markdown]
# ## 1. What moves, device by device
#
# A tiny example makes the two strategies concrete: `qwen3.5-tiny` with 16 experts instead of 8 (2 on each device,
# so a token can pick two experts on one device), top-3, and `N = 16` tokens, `n = 2` on each device. The routing
# is the real router's (`model.moe.route`); the collectives are the library's own (`collectives.all_gather`,
# `gather_routing`, `reduce_scatter`), run by hand on the 8 devices with `on_each_device`, as notebook 04 does for
# the hierarchical reduce-scatter. Every row carries its token's number, so a printout says which token went where.

# %%
import jax.numpy as jnp
import numpy as np

import qwen35_lib
from qwen35_lib.model.moe import route
from qwen35_lib.parallel.collectives import on_each_device
from qwen35_lib.plan import get_layout

tiny = qwen35_lib.get_config("qwen3.5-tiny", dtype="float32")
EP = get_layout("dp8_ep8")  # the serving plan's placement; each strategy below is this plan with a routing

demo = tiny.replace(num_experts=16)  # 2 experts per device
demo_weights = qwen35_lib.init_weights(demo, 0)
demo_router = demo_weights["layers"]["moe"]["router"][0, 0]  # [D, 16], the first MoE layer's
n, k_demo, count = 2, demo.num_experts_per_tok, demo.num_experts // 8
x_demo = np.random.default_rng(2).standard_normal((8 * n, demo.hidden_size)).astype(np.float32)  # [N, D]
w_demo, ids_demo = (np.asarray(a) for a in route(demo, demo_router, jnp.asarray(x_demo)))  # [N, k] each
dest = ids_demo // count  # [N, k]: the device of each copy's expert
by_device = lambda a: np.asarray(a).reshape(8, -1, *np.shape(a)[1:])  # [N, ...] -> [8, N / 8, ...], device-major
per_device = lambda fn, a: on_each_device(fn, by_device(a), mesh)  # fn on device i's rows of a, stacked
token_no = np.arange(8 * n, dtype=np.int32)[:, None]  # [N, 1]: token t's row holds t
print("token: its top-3 expert ids -> their devices")
for first in range(0, 8 * n, 4):
    print("  " + ";  ".join(f"{t:>2}: {ids_demo[t].tolist()} -> {dest[t].tolist()}" for t in range(first, first + 4)))

# %% [markdown]
# **Step by step.** Before the library's collectives run below, the two strategies drawn with these very routes:
# each device a box, each token a square in the colour of the device it came from. Replication all-gathers every
# token to every device, and each device then computes the copies its own experts were chosen for; dispatch sends
# each token only to the devices of its experts, and a second all-to-all brings the results back.

# %%
# figure: collective_steps
from qwen35_lib.viz.teaching import plot_collective_steps

plot_collective_steps(dest.reshape(8, n, k_demo).tolist())

# %% [markdown]
# ### Replication: all-gather, local experts, reduce-scatter
#
# <details><summary><b>Pop quiz.</b> After the all-gather every device holds every token. Does each device then
# run one expert computation per token?</summary>
#
# No: one per *copy* whose expert it owns. A token that picked both of a device's experts is run twice there, a
# token that picked neither not at all, so the work differs from device to device. The printout lists each
# device's copies; after the experts, the reduce-scatter sends each token's sum home, and that sum comes from
# exactly the devices that ran its copies.
# </details>
#
# **Predict.** The all-gather turns `x[N_x, D]` (`n` rows a device) into `x[N, D]` on every device, device-major;
# the top-k ids and weights travel the same way (here in one packed all-gather, `fuse_allgather`: notebook 04).
# Device `d` then runs its experts `2d, 2d + 1` on the copies routed to them.
#
# **Measure.** The library's collectives on the 8 devices.

# %%
from qwen35_lib.parallel.collectives import all_gather, gather_routing

gathered_x = per_device(all_gather, x_demo)  # [8, N, D]: the hidden states themselves
gathered = per_device(all_gather, token_no)  # [8, N, 1]: their numbers, to print
packed = np.concatenate([ids_demo.astype(np.float32), w_demo], axis=1)  # [N, 2k]: ids beside weights, one array to pass
routing_seen = per_device(lambda v: jnp.concatenate(
    [a.astype(jnp.float32) for a in gather_routing(v[:, :k_demo].astype(jnp.int32), v[:, k_demo:], fused=True)],
    axis=1), packed)  # [8, N, 2k]: what each device holds after gather_routing
copies = {d: sorted(int(t) for t in np.nonzero(dest == d)[0]) for d in range(8)}  # token of each local copy
print(f"all_gather: x {by_device(x_demo).shape[1:]} per device -> {gathered_x.shape[1:]}; "
      f"ids and weights {by_device(packed[:, :k_demo]).shape[1:]} -> {routing_seen[:, :, :k_demo].shape[1:]} each")
for d in range(8):
    print(f"  device {d}: tokens {by_device(token_no)[d, :, 0].tolist()} -> {gathered[d, :, 0].tolist()}; "
          f"experts {d * count}, {d * count + 1} run the copies of tokens {copies[d]}")

# %% [markdown]
# **Predict.** After the experts every device holds partial sums `{y[N, D]}_U` for all `N` tokens, zero where
# none of its experts ran. The reduce-scatter sums them over the devices and leaves each device its own `n` rows,
# `y[N_x, D]`. To see who contributed, let device `d` write `2^d` into the rows of the tokens its experts ran: the
# binary digits of each sum then name the devices it came from.
#
# **Measure.** `collectives.reduce_scatter`, flat (one `psum_scatter` over `('chip', 'core')`).

# %%
from qwen35_lib.parallel.collectives import reduce_scatter

ran = (dest[None, :, :] == np.arange(8)[:, None, None]).any(axis=2)  # [8, N]: device d ran a copy of token t
partials = np.repeat((ran * 2.0 ** np.arange(8)[:, None])[:, :, None], demo.hidden_size, axis=2)  # [8, N, D]
partials = partials.astype(np.float32)
summed = on_each_device(lambda v: reduce_scatter(v, hierarchical=False), partials, mesh)  # [8, n, D]
senders = lambda total: [d for d in range(8) if int(total) >> d & 1]  # the devices whose 2^d are in a sum
print(f"reduce_scatter: partial sums {partials.shape[1:]} per device -> {summed.shape[1:]}")
for d in range(8):
    print(f"  device {d}: " + ", ".join(f"token {d * n + i} summed from devices {senders(summed[d, i, 0])}"
                                        for i in range(n)))

# %% [markdown]
# ### All-to-all dispatch
#
# <details><summary><b>Pop quiz.</b> Dropless, each device fills a buffer of `cap = n` rows for every device,
# itself included (all its tokens could go to one). How many of those rows carry a token?</summary>
#
# A token fills a row at each device that owns at least one of its experts, and only one: a token with two
# experts on one device goes there once, carrying both ids. The rest is padding, sent anyway, because the
# buffer's shape cannot depend on the routing (dots below). A device's buffers hold `8 x n` rows in all, as many
# as the all-gather's result: that is why section 2 finds the static all-to-all moving as many bytes as
# replication.
# </details>
#
# **Predict.** Device `s` fills row `p` of its buffer for device `e` with its `p`-th token that has an expert on
# `e` (`routing.moe_ep` builds the same buffer, and packs each row's expert ids and weights in a second one). The
# all-to-all hands device `e` the `e`-th buffer of every device: `[8, cap, D]` in, `[8, cap, D]` out, the same
# shape, other rows. A second all-to-all, the inverse, brings each row's partial output home.
#
# **Measure.** `jax.lax.all_to_all` over `('chip', 'core')`, as `moe_ep` calls it.

# %%
import jax

from qwen35_lib.plan import ALL

goes = (dest[:, :, None] == np.arange(8)).any(axis=1)  # [N, 8]: token t goes to device e (once, deduplicated)
send = np.full((8, 8, n), -1, np.int32)  # [source, destination, cap = n]: token numbers, -1 an empty row
for s_ in range(8):
    for e in range(8):
        toks = [t for t in range(s_ * n, (s_ + 1) * n) if goes[t, e]]
        send[s_, e, :len(toks)] = toks
a2a = lambda v: jax.lax.all_to_all(v, ALL, 0, 0, tiled=True)  # split rows by destination, concatenate by source
recv = on_each_device(a2a, send, mesh)  # [device, source, cap]
home = on_each_device(a2a, recv, mesh)  # the return trip: [device, destination, cap]
rows = lambda buf: " | ".join(" ".join(f"{t:>2}" if t >= 0 else " ." for t in b) for b in buf)
print(f"all_to_all: rows [destination, cap] {send.shape[1:]} per device -> [source, cap] {recv.shape[1:]} "
      f"(x[8, cap, {demo.hidden_size}] and the packed ids and weights [8, cap, {2 * k_demo}] move the same way)")
for d in range(8):
    print(f"  device {d} sends to 0..7:     {rows(send[d])}   ({(send[d] >= 0).sum()} of {send[d].size} rows used)")
for d in range(8):
    print(f"  device {d} receives from 0..7: {rows(recv[d])}")

# %% [markdown]
# **Check.** Every device holds every token and the whole routing after the all-gathers; each token's sum comes
# home from exactly the devices of its experts; the all-to-all delivers device `s`'s `e`-th buffer to device `e`,
# and the second one brings it back. The rows are the real layer's: `moe_ep` (with `with_rows`) reports, per
# device, the local copies it ran (replicate) and the token rows it sent (all_to_all), and they equal the counts
# printed above.

# %%
from qwen35_lib.parallel import routing, shard_weights

assert (gathered_x == x_demo[None]).all() and (gathered[:, :, 0] == np.arange(8 * n)).all()
assert (routing_seen == packed[None]).all()
assert all(senders(summed[t // n, t % n, 0]) == sorted(set(dest[t].tolist())) for t in range(8 * n))
assert (recv == send.transpose(1, 0, 2)).all() and (home == send).all()
moved = {}
for r in ("replicate", "all_to_all"):
    plan = EP.replace(routing=r).bind(mesh, demo)
    w = jax.tree.map(lambda a: a[0, 0], shard_weights(demo, plan, demo_weights, mesh)["layers"]["moe"])
    with jax.set_mesh(mesh):
        moved[r] = np.asarray(jax.jit(lambda w, x, p=plan: routing.moe_ep(demo, w, x, route, p, with_rows=True)[2])(
            w, jnp.asarray(x_demo)))
assert moved["replicate"].tolist() == [len(copies[d]) for d in range(8)], moved
assert moved["all_to_all"].tolist() == (send >= 0).sum(axis=(1, 2)).tolist(), moved
print("moe_ep's rows per device:", {r: v.tolist() for r, v in moved.items()})

# %% [markdown]
# ## 2. Bytes per MoE layer
#
# <details><summary><b>Pop quiz.</b> With top-10 of 512 experts on 8 devices, which moves fewer bytes per MoE
# layer: all-gathering every token to every device, or sending each token only to the devices that own its
# experts?</summary>
#
# Sending by address, but by less than one might expect: a token's 10 experts land on most of the 8 devices (the
# first cell prints the average), so even an ideal, deduplicated all-to-all sends most tokens to most devices. And
# a static buffer, sized for the worst case as section 1's was, is as large as the all-gather's result.
# </details>
#
# **Predict.** A step holds `N` tokens, `n = N / 8` per device, hidden size `D`, `k` experts per token, `b`
# bytes per activation (bf16: 2). Per device, the bytes of each collective (an all-gather's result, a
# reduce-scatter's input, an all-to-all's buffer), as the cost model lists them (`costmodel.traffic.moe_layer_ops`,
# the ops it prices for every step):
#
# | strategy | collectives per MoE layer | bytes per device |
# |---|---|---|
# | `replicate` | all-gather `x`, ids, weights; reduce-scatter `y` | `N·D·b + N·k·4 + N·k·b`; `N·D·b` |
# | `all_to_all` | all-to-all `x` there, packed ids/weights there, `y` back | `2 · 8·cap·D·b + 8·cap·2k·4` |
# | ideal ragged `all_to_all` | the same, only the rows the routing needs | `rows · (2·D·b + 2k·4)` |
#
# where `cap` is the buffer rows per destination device. A token is sent to a device **once**, however many of
# its `k` experts live there (the packed ids and weights say which: the all-to-all is *deduplicated*), so dropless
# needs `cap = n` rows (all of a device's tokens could go to one device), and a capacity factor `f` allows
# `ceil(f · n·k / 8)` of them, at most `n`. A static buffer (what a TPU compiles: the shapes cannot depend on the
# routing) of `cap = n` is as large as the all-gather's result. The ideal, a ragged all-to-all that sends the
# rows the routing needs, sends `rows = n · 8 · (1 - C(E - E/8, k) / C(E, k))` (the expected distinct devices of a
# token's `k` experts: `costmodel.step.expected_a2a_rows`). On the wire a device receives 7/8 of an all-gather's or
# all-to-all's result (its own block stays), and sends 7/8 of a reduce-scatter's *input* (`N·D·b`).

# %%
from qwen35_lib.costmodel import traffic
from qwen35_lib.costmodel.step import expected_a2a_rows
from qwen35_lib.plan import abstract_mesh
from qwen35_lib.report import human_bytes

big = qwen35_lib.get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn")

STRATEGIES = {"replicate": dict(routing="replicate"), "all_to_all (dropless)": dict(routing="all_to_all"),
              "all_to_all (f = 1.25)": dict(routing="all_to_all", capacity_factor=1.25)}
D, k, b = big.hidden_size, big.num_experts_per_tok, 2  # bf16 activations
layer_ops = lambda kw, N, m=big: traffic.moe_layer_ops(EP.replace(**kw).bind(abstract_mesh(8), m), m, N)  # 1 layer
wire = lambda kw, N: traffic.wire_bytes(layer_ops(kw, N))  # bytes one device puts on its links
ragged_rows = lambda N: expected_a2a_rows(big, N // 8, 8)  # rows one device sends, deduplicated, no padding
ragged_wire = lambda N: 7 / 8 * ragged_rows(N) * (2 * D * b + 2 * k * 4)
for N in (512, 8 * 2048):
    row = {s: human_bytes(wire(kw, N)) for s, kw in STRATEGIES.items()}
    row["all_to_all (ideal ragged)"] = human_bytes(ragged_wire(N))
    print(f"397B, N = {N:>5} tokens per step: {row}")
print(f"distinct devices a token's {k} experts reach, on average: {ragged_rows(512) / (512 // 8):.2f} of 8")

# Start the TPU7x compiles of the next section now (one MoE layer per strategy, ~10 s), in a thread beside the cells
# between; "The compiled layer" reads them.
import concurrent.futures
import importlib.util

from qwen35_lib import aot
from qwen35_lib.parallel import hlo

mini = qwen35_lib.get_config("qwen3.5-mini")
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None  # the 'tpu' extra
tpu_compiles = concurrent.futures.ThreadPoolExecutor(1).submit(
    lambda: {s: hlo.count(aot.compile_moe_layer(mini, EP.replace(**kw), aot.chip_core_mesh(), 512).as_text(),
                          moved=True) for s, kw in STRATEGIES.items()}) if HAVE_LIBTPU else None

# %% [markdown]
# **Check.** With top-10 over 8 devices a token reaches most devices anyway, so the ideal ragged all-to-all saves
# only the devices it misses: fewer bytes than replication, but not many fewer. The static dropless buffer, and at
# `k = 10` also the capped one (`ceil(f·n·k/8)` exceeds `n`), moves as much as replication.

# %%
notebook.claim_greater("token_reaches_most_devices", "a token's top-{k} experts reach {reached:.2f} of the 8 "
                       "devices on average, most of them", reached=ragged_rows(512) / (512 // 8), half=4, k=k)
for N in (512, 8 * 2048):
    rep_b = wire(dict(routing="replicate"), N)
    static_b = wire(dict(routing="all_to_all"), N)
    assert ragged_wire(N) < rep_b <= static_b, (N, ragged_wire(N), rep_b, static_b)
    assert wire(dict(routing="all_to_all", capacity_factor=1.25), N) == static_b
notebook.claim("static_as_much_as_replication", "as much as replication: at {n:,} tokens a step the padded dropless "
               "buffer puts {static:.0f} MiB a layer on a device's links, replication {rep:.0f} MiB, and a capacity "
               "factor of 1.25 changes nothing", rep_b <= static_b == wire(dict(routing="all_to_all",
                                                                                 capacity_factor=1.25), N),
               "replicate <= static == capped static", n=N, static=static_b / 2**20, rep=rep_b / 2**20)

# %% [markdown]
# ### Per-link load on the ring, and latency
#
# <details><summary><b>Pop quiz.</b> The ideal ragged all-to-all moves fewer bytes than replication. Is it faster
# on a TPU7x-8?</summary>
#
# Not at a prefill-sized step: on a ring, an all-gather's bytes each cross one link per step around it, while an
# all-to-all message to a device `d` hops away loads `d` links, so fewer bytes still mean more traffic per link.
# At a small decode step the bytes hardly matter and the count of collectives does: the all-to-all's three beat
# replication's four. The cell below prices both ends.
# </details>
#
# **Compute.** Bytes are not time. The 8 TensorCores of a TPU7x-8 sit on a ring of 4 chips (2 cores a chip): an
# all-gather or reduce-scatter runs *around* the ring, each byte crossing each link it needs once, while an
# all-to-all message to a device `d` hops away loads `d` links on its way. Per byte delivered, an all-to-all on a
# ring of 8 loads each link `sum_d min(d, 8 - d) / 7` times what an all-gather does
# (`costmodel.collectives.ring_hops_sum`). Against that, every collective pays a launch and a latency per hop, and
# replication runs four of them per layer to the all-to-all's three. The cost model's collective formulas
# (`costmodel.collectives`, TPU7x-8 specs from `data/hardware.json`) price one MoE layer of each strategy from a
# decode-sized step to a prefill-sized one.

# %%
import dataclasses

from qwen35_lib.costmodel import collectives as cc
from qwen35_lib.costmodel import specs as hw_specs
from qwen35_lib.costmodel.step import op_comm

tpu = hw_specs.get("tpu7x-8")
link_load = cc.ring_hops_sum(8) / 7  # all-to-all's per-link bytes per byte delivered, over the all-gather's


def layer_seconds(strategy: str, N: int) -> float:
    """One MoE layer's collectives on a TPU7x-8, priced as the cost model prices a step's (`step.op_comm`)."""
    kw = dict(routing="replicate" if strategy == "replicate" else "all_to_all")
    ops = layer_ops(kw, N)
    if strategy == "ragged":  # the static buffer's all-to-alls, carrying only the rows the routing needs
        rows = 8 * routing.a2a_cap(big, EP.replace(**kw), N // 8, 8)
        ops = [dataclasses.replace(op, bytes=op.bytes * ragged_rows(N) / rows) for op in ops]
    return sum(op_comm(tpu, op).seconds * op.runs for op in ops)


STEP_TOKENS = (64, 512, 8 * 2048)
seconds = {N: {s: layer_seconds(s, N) for s in ("replicate", "static", "ragged")} for N in STEP_TOKENS}
print(f"per-link load of an all-to-all per byte delivered: {link_load:.2f}x an all-gather's")
for N, row in seconds.items():
    print(f"N = {N:>5}: " + ", ".join(f"{s} {t * 1e6:7.1f} us" for s, t in row.items()))

# %% [markdown]
# **Check.** At a prefill-sized step the ideal ragged all-to-all, with fewer bytes, still takes longer than
# replication: its messages load the ring's links more. At a small decode step, latency rules and fewer
# collectives win. At the serving decode step (512 requests, a token each) replication and the ideal all-to-all are
# within a tenth of each other, and replication beats the padded static all-to-all. The padded static all-to-all is
# never faster than the ragged one.

# %%
big_step = STEP_TOKENS[-1]
assert ragged_wire(big_step) < wire(dict(routing="replicate"), big_step)
assert seconds[big_step]["ragged"] > seconds[big_step]["replicate"]
small = seconds[STEP_TOKENS[0]]
notebook.claim_greater("latency_favours_all_to_all", "at a small decode step replication's four collectives a layer "
                       "cost more than the all-to-all's three: {replicate:.1f} µs against {ragged:.1f} µs at {n} "
                       "tokens", replicate=small["replicate"] * 1e6, ragged=small["ragged"] * 1e6, n=STEP_TOKENS[0])
assert all(row["static"] >= row["ragged"] for row in seconds.values())
serving = seconds[512]  # the decode step at 512 concurrent requests
assert abs(serving["replicate"] / serving["ragged"] - 1) < 0.1 and serving["replicate"] < serving["static"], serving

# %% [markdown]
# ### The compiled layer
#
# **Measure, as a TPU7x-8 would.** One MoE layer (`routing.moe_ep`, the same function the model calls),
# compiled for `tpu7x:2x2x1` with abstract weights, at the `qwen3.5-mini` width (`D = 512`, `k = 8`): the 397B
# width takes minutes per compile here; the formula is the same. XLA reports each collective with its shape.

# %%
tpu_counts = {}
if HAVE_LIBTPU:  # the compiles started where STRATEGIES is defined: `aot.compile_moe_layer` for each one
    for s, counts in tpu_compiles.result().items():
        tpu_counts[s] = {kind: v for kind, v in counts.items() if v["bytes"] > 4}  # drop the 4-byte drop counter
        print(f"TPU7x, qwen3.5-mini width, N = 512: {s:<22} {tpu_counts[s]}")
else:
    print("libtpu not installed (pip install 'jax[tpu]'): skipped the TPU7x compiles")

# %% [markdown]
# **Check.** The compiled layer moves exactly the predicted bytes, with 3 all-gathers + 1 reduce-scatter, or 3
# all-to-alls.

# %%
for s, counts in tpu_counts.items():
    kw = STRATEGIES[s]
    want = traffic.layer_bytes(layer_ops(kw, 512, mini))
    assert {kind: v["bytes"] for kind, v in counts.items()} == want, (s, counts, want)
    assert {kind: v["count"] for kind, v in counts.items()} == (
        {"all-gather": 3, "reduce-scatter": 1} if kw["routing"] == "replicate" else {"all-to-all": 3})

# %%
import matplotlib.pyplot as plt

# figure: wire_bytes
Ns = [64, 256, 512, 2048, 8 * 2048]
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
for s, kw in STRATEGIES.items():
    ax.plot(Ns, [wire(kw, N) / 2**20 for N in Ns], marker="o", label=s)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens per step N (all 8 devices)")
ax.set_ylabel("MiB per device per MoE layer")
ax.set_title("Qwen3.5-397B: bytes on the wire per MoE layer (prediction; formula checked by the TPU7x compile)",
             fontsize=9)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 3. Dropping, counted
#
# <details><summary><b>Pop quiz.</b> With a capacity factor `f = 1`, will a balanced random routing drop any
# copies?</summary>
#
# Yes: `f = 1` sizes each destination's buffer for the average, and a random routing sends more than the average to
# some destinations, so their last tokens are cut. A skewed routing, piling tokens onto one device's experts, drops
# far more. The first cell counts both from the routing alone; the second drops them for real.
# </details>
#
# **Predict.** With a capacity factor `f`, each device may send at most `cap = ceil(f·n·k/8)` tokens to each
# other device; the copies of the tokens past the first `cap` are dropped (their expert output is missing from
# the token's sum). The count needs only the routing: for every source device and destination, the copies of
# the tokens that rank past `cap` among those going there. A skewed routing (most
# tokens preferring expert 0, on device 0) drops far more than a balanced one.
#
# At CPU size: `qwen3.5-tiny` (8 experts, top-3: one expert per device), a batch of random hidden states, float32.
# The skewed ones are the same pushed along the router's column for expert 0.

# %%
weights = qwen35_lib.init_weights(tiny, 0)  # 8 experts again: one per device
layer = jax.tree.map(lambda a: a[0, 0], weights["layers"]["moe"])  # the first MoE layer
r0 = np.asarray(layer["router"][:, 0])
rng = np.random.default_rng(0)
balanced = rng.standard_normal((64, tiny.hidden_size)).astype(np.float32)
skewed = balanced + 3.0 * r0 / np.linalg.norm(r0)  # every token leans towards expert 0

capped = {f: EP.replace(routing="all_to_all", capacity_factor=f) for f in (1.0,)}
batches = {"balanced": balanced, "skewed": skewed}
ids = {name: route(tiny, layer["router"], jnp.asarray(x))[1] for name, x in batches.items()}  # [64, k] each
print({name: routing.predicted_drops(tiny, capped[1.0], i) for name, i in ids.items()})

# %% [markdown]
# **Measure.** `moe_ep` returns the number of dropped copies along with the output.

# %%
results = {}
for name, x in (("balanced", balanced), ("skewed", skewed)):
    results[name] = {s: routing.run_layer(tiny, EP.replace(routing=r, capacity_factor=f), weights, x, mesh)
                     for s, (r, f) in {"replicate": ("replicate", None), "all_to_all": ("all_to_all", None),
                                       "all_to_all f=1": ("all_to_all", 1.0)}.items()}
    print(f"{name:<9} dropped copies: " + ", ".join(f"{s}: {d}" for s, (_, d) in results[name].items()))

# %% [markdown]
# **Check.** Dropless strategies drop nothing and equal the dense reference (every expert on every token,
# masked by the routing weights: `moe_dense_reference`, less its shared expert); the capped all-to-all drops
# exactly the predicted copies, more under skew.

# %%
from qwen35_lib.model.moe import moe_dense_reference, shared_expert

for name, x in (("balanced", balanced), ("skewed", skewed)):
    ref = np.asarray(moe_dense_reference(tiny, layer, jnp.asarray(x)) - shared_expert(layer, jnp.asarray(x)))
    for s in ("replicate", "all_to_all"):
        out, dropped = results[name][s]
        assert dropped == 0
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert results[name]["all_to_all f=1"][1] == routing.predicted_drops(tiny, capped[1.0], ids[name])
assert results["skewed"]["all_to_all f=1"][1] > results["balanced"]["all_to_all f=1"][1]

# %% [markdown]
# ## 4. Determinism: does my answer depend on my neighbours?
#
# <details><summary><b>Pop quiz.</b> Keep your tokens and change only the others in the batch. Under which
# strategy can your tokens' outputs change?</summary>
#
# Under the capped all-to-all: its buffer slots go first come, first served, so tokens that arrive earlier and
# crowd the same experts take the slots your copies needed. Under replication every token's output is computed
# from that token alone, and the dropless all-to-all has a slot for everyone. The cells below count the changed
# outputs.
# </details>
#
# **Predict.** Replication computes every token's output from that token alone, whoever else is in the batch. A
# capped all-to-all gives buffer slots first come, first served on each device: a token whose device also carries
# tokens crowding the same experts loses some of its copies. Keep tokens 4-7 of every device's 8 the same, and make
# tokens 0-3 (which claim slots first) either balanced or skewed.
#
# **Measure.** The same layer on the mixed batch, against the balanced run of section 3.

# %%
mixed = balanced.copy()
first_half = (np.arange(64) % 8) < 4
mixed[first_half] = skewed[first_half]
same_rows = ~first_half
changed = {}
for s, (r, f) in {"replicate": ("replicate", None), "all_to_all f=1": ("all_to_all", 1.0)}.items():
    alone, _ = results["balanced"][s]
    crowded, _ = routing.run_layer(tiny, EP.replace(routing=r, capacity_factor=f), weights, mixed, mesh)
    changed[s] = int((np.abs(crowded[same_rows] - alone[same_rows]).max(axis=1) > 1e-6).sum())
    print(f"{s:<15} tokens (of {same_rows.sum()} unchanged ones) whose output changed: {changed[s]}")

# %% [markdown]
# **Check.** Replication: no token's output moves. The capped all-to-all: some do, for no fault of their own.

# %%
assert changed["replicate"] == 0 and changed["all_to_all f=1"] > 0

# %%
import re

# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
key = lambda name: re.sub(r"\W+", "_", name).strip("_")  # "all_to_all (f = 1.25)" -> "all_to_all_f_1_25"
record = dict(
    wire_bytes_397b={str(N): {key(s): wire(kw, N)
                              for s, kw in STRATEGIES.items()} for N in Ns},
    tpu7x_mini_collectives={key(s): v for s, v in tpu_counts.items()},
    dropped={name: {key(s): d for s, (_, d) in r.items()} for name, r in results.items()},
    outputs_changed_by_neighbours={key(s): v for s, v in changed.items()},
    ragged_wire_bytes_397b={str(N): ragged_wire(N) for N in Ns}, distinct_devices=ragged_rows(512) / (512 // 8),
    link_load_ratio=link_load, step_tokens=list(STEP_TOKENS),
    layer_us={str(N): {s: t * 1e6 for s, t in row.items()} for N, row in seconds.items()},
    stages=stages)
notebook.save_results("token_routing", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> With top-10 routing over 8 devices a token reaches most devices anyway, so even an ideal,
# deduplicated ragged all-to-all saves only a fraction of replication's bytes, and on a ring it loads each link
# more per byte; replication's collectives have static shapes, need no capacity to tune, drop nothing, and give
# every request the same answer whatever else is in the batch. That is why production replicates.
# </div>
#
# ## What we learned
#
# - Replication and all-to-all are two ways of bringing a token to its experts' devices: by broadcast or by
#   address. When a token's experts cover most devices, as top-10 over 8 does, the address saves little.
# - A static shape is a worst-case promise: a dropless all-to-all buffer is mostly padding, as large as an
#   all-gather, and a smaller one must drop.
# - Bytes are not time. On a ring an all-to-all loads more links per byte delivered, and at small steps the number
#   of collectives, each with its latency, matters more than their bytes.
# - Dropping is not only lossy but unfair: a capped buffer makes a token's answer depend on its neighbours.
# - The per-device printouts are the invariant to check any routing against: each token's output is summed from
#   exactly the devices that own its experts, and the real layer's row counts agree with the hand-built ones.

# %% [markdown]
# ## Exercises
#
# 1. **[Crossover]** For which top-`k` would an all-to-all with `f = 1.25` move fewer bytes than replication, at
#    `N = 512`?
#    <details><summary>Answer</summary>
#
#    Per device and per token of the step, replication moves about `2 · 7/8 · D·b` on the wire (the all-gather,
#    and the reduce-scatter's input), whatever `k`; the capped all-to-all only ships the device's own eighth of the
#    tokens, `k` copies each, there and back: `2 · 7/8 · f·k·D·b / 8`, linear in `k`. Compare the wire bytes of
#    the cost model's ops of one layer (this notebook's `wire`, with the model `big.replace(num_experts_per_tok=k)`
#    and the plan `EP.replace(routing=r, capacity_factor=f)`) for `k = 1 ... 10`: the capped all-to-all is
#    cheaper up to `k = 6` and dearer from `k = 7`. Qwen3.5's `k = 10` is past the crossover; without dropping
#    (dropless buffers) it never wins.
#    </details>
#
# 2. **[How much capacity]** What capacity factor makes the skewed batch of section 3 drop nothing?
#    <details><summary>Answer</summary>
#
#    Raise `f` in `routing.predicted_drops` for the skewed routing until it returns 0, then confirm with
#    `routing.run_layer` (all_to_all, skewed, f). The answer is well above `f = 1`: a buffer sized for the average
#    is not enough for a skewed batch, and the bytes of the all-to-all grow with it (until `cap` reaches `n`, the
#    dropless buffer).
#    </details>
#
# 3. **[Dropless all-to-all on TPU]** Why is `ragged_all_to_all` the better primitive for a dropless dispatch?
#    <details><summary>Answer</summary>
#
#    It sends each destination exactly the tokens routed to it (sizes exchanged first), instead of `cap = n`
#    padded rows per destination: the bytes become what the routing needs, no worst-case padding. XLA:CPU does
#    not implement it, which is why the library pads here.
#    </details>

# %% [markdown]
# **The answers, computed.** Each exercise's numbers, from this run, folded until you open them.

# %%
def wire_k(kw, top_k, N=512):  # one MoE layer's wire bytes per device, for the model with top-k routing
    m = big.replace(num_experts_per_tok=top_k)
    return traffic.wire_bytes(traffic.moe_layer_ops(EP.replace(**kw).bind(abstract_mesh(8), m), m, N))


K = big.num_experts_per_tok
capped_wire = {top_k: wire_k(STRATEGIES["all_to_all (f = 1.25)"], top_k) for top_k in range(1, K + 1)}
replicate_wire = {top_k: wire_k(STRATEGIES["replicate"], top_k) for top_k in range(1, K + 1)}
last = max((t for t in capped_wire if capped_wire[t] < replicate_wire[t]), default=0)
notebook.answer(1, "the capped all-to-all (f = 1.25) moves fewer bytes than replication for k up to {last}, and at "
                "least as many from k = {first_more}; at Qwen3.5's k = {k}: {a2a:.2f} MiB against {rep:.2f} MiB a "
                "layer.",
                last=last, first_more=last + 1, k=K, a2a=capped_wire[K] / 2**20, rep=replicate_wire[K] / 2**20)
factor = next(f / 4 for f in range(4, 8 * 4 * 8 + 1) if routing.predicted_drops(
    tiny, EP.replace(routing="all_to_all", capacity_factor=f / 4), ids["skewed"]) == 0)
notebook.answer(2, "f = {f:.2f} (searched in steps of 0.25): the skewed batch drops nothing from there on, against "
                "{d} dropped at f = 1.", f=factor, d=routing.predicted_drops(tiny, capped[1.0], ids["skewed"]))
notebook.answer(3, "at N = 512 a ragged all-to-all would put {ragged:.2f} MiB a layer on a device's links against "
                "{static:.2f} MiB for the padded dropless buffer: {ratio:.0%} of it.", ragged=ragged_wire(512) / 2**20,
                static=wire(STRATEGIES["all_to_all (dropless)"], 512) / 2**20,
                ratio=ragged_wire(512) / wire(STRATEGIES["all_to_all (dropless)"], 512))
