# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
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
# Install the library when it is not importable (e.g. on Colab): a checkout gives data/ too. The 'reference'
# extra asks for a torch range, so an installed torch (Colab's) is kept; on a TPU runtime the 'tpu' extra brings
# the libtpu that matches the pinned jax.
import glob
import importlib.util
import os
import pathlib
import subprocess
import sys

REPO = "qwen35-playbook/qwen35-playbook"
REPO = os.environ.get("QWEN35_REPO") or REPO  # a fork to clone instead
if importlib.util.find_spec("qwen35_lib") is None:
    checkout = pathlib.Path.cwd().parent
    if not (checkout / "qwen35_lib").is_dir():  # not run from a checkout's notebooks/: fetch one
        checkout = pathlib.Path("qwen35-playbook").resolve()
        subprocess.run(["git", "clone", "--depth", "1", f"https://github.com/{REPO}", str(checkout)], check=True)
        extras = "tpu,reference" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") else "reference"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{checkout}[{extras}]"], check=True)
    sys.path.insert(0, str(checkout))

# %%
# Devices and size: the accelerator's own devices, else 8 simulated CPU devices (before anything starts
# JAX's backend), and the size this notebook runs at (`QWEN35_SIZE` overrides it).
from qwen35_lib import notebook

devices, SIZE = notebook.setup()

# %%
# %matplotlib inline

import dataclasses
import re

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import qwen35_lib
from qwen35_lib import aot
from qwen35_lib.costmodel import collectives as cc
from qwen35_lib.costmodel import specs as hw_specs
from qwen35_lib.costmodel import traffic
from qwen35_lib.costmodel.stages import resolve_layout
from qwen35_lib.costmodel.step import expected_a2a_rows, op_comm
from qwen35_lib.model.moe import moe_dense_reference, route, shared_expert
from qwen35_lib.parallel import hlo, make_mesh, plan_of, routing
from qwen35_lib.report import human_bytes
from qwen35_lib.stage_gain import gain_table, stage_gain

mesh = make_mesh()
tiny = qwen35_lib.get_config("qwen3.5-tiny", dtype="float32", layout="dp8_ep8")
big = qwen35_lib.get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn", layout="dp8_ep8")

# %% [markdown]
# ## 0. What replication buys (the cost model, TPU7x-8)
#
# **Compute.** The `replicate` stage against `dp_ep` (notebook 02): the same layout, the same experts, only the
# routing changes. Milliseconds per 1,000 tokens served by component, both workloads at 512 concurrent requests.

# %%
stages = {"replicate": stage_gain("replicate")}
print(gain_table(stages["replicate"]))

# %% [markdown]
# **Check.** The whole gain is in the collectives: attention, GDN and the experts' work are the same under both
# routings. Sections 1 and 2 say where it comes from.

# %%
for wl in ("8k/1k", "1k/8k"):
    change = stages["replicate"][wl]["component_change"]
    assert all(abs(change[g]) < 1e-9 for g in ("attention", "gdn", "moe")), (wl, change)
    assert change["collectives"] < 0 and stages["replicate"][wl]["gain"] > 1, (wl, change)

# %% [markdown]
# ## 1. Bytes per MoE layer
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
STRATEGIES = {"replicate": dict(routing="replicate"), "all_to_all (dropless)": dict(routing="all_to_all"),
              "all_to_all (f = 1.25)": dict(routing="all_to_all", capacity_factor=1.25)}
D, k, b = big.hidden_size, big.num_experts_per_tok, 2  # bf16 activations
layer_ops = lambda cfg, N: traffic.moe_layer_ops(resolve_layout(plan_of(cfg), cfg, 8), cfg, N)  # one MoE layer
wire = lambda cfg, N: traffic.wire_bytes(layer_ops(cfg, N))  # bytes one device puts on its links
ragged_rows = lambda N: expected_a2a_rows(big, N // 8, 8)  # rows one device sends, deduplicated, no padding
ragged_wire = lambda N: 7 / 8 * ragged_rows(N) * (2 * D * b + 2 * k * 4)
for N in (512, 8 * 2048):
    row = {s: human_bytes(wire(big.replace(**kw), N)) for s, kw in STRATEGIES.items()}
    row["all_to_all (ideal ragged)"] = human_bytes(ragged_wire(N))
    print(f"397B, N = {N:>5} tokens per step: {row}")
print(f"distinct devices a token's {k} experts reach, on average: {ragged_rows(512) / (512 // 8):.2f} of 8")

# %% [markdown]
# **Check.** With top-10 over 8 devices a token reaches most devices anyway, so the ideal ragged all-to-all saves
# only the devices it misses: fewer bytes than replication, but not many fewer. The static dropless buffer, and at
# `k = 10` also the capped one (`ceil(f·n·k/8)` exceeds `n`), moves as much as replication.

# %%
for N in (512, 8 * 2048):
    rep_b = wire(big.replace(routing="replicate"), N)
    static_b = wire(big.replace(routing="all_to_all"), N)
    assert ragged_wire(N) < rep_b <= static_b, (N, ragged_wire(N), rep_b, static_b)
    assert wire(big.replace(routing="all_to_all", capacity_factor=1.25), N) == static_b

# %% [markdown]
# ### Per-link load on the ring, and latency
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
tpu = hw_specs.get("tpu7x-8")
link_load = cc.ring_hops_sum(8) / 7  # all-to-all's per-link bytes per byte delivered, over the all-gather's


def layer_seconds(strategy: str, N: int) -> float:
    """One MoE layer's collectives on a TPU7x-8, priced as the cost model prices a step's (`step.op_comm`)."""
    cfg = big.replace(routing="replicate" if strategy == "replicate" else "all_to_all")
    ops = layer_ops(cfg, N)
    if strategy == "ragged":  # the static buffer's all-to-alls, carrying only the rows the routing needs
        rows = 8 * routing.a2a_cap(cfg, N // 8, 8)
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
# collectives win. The padded static all-to-all is never faster than the ragged one.

# %%
big_step = STEP_TOKENS[-1]
assert ragged_wire(big_step) < wire(big.replace(routing="replicate"), big_step)
assert seconds[big_step]["ragged"] > seconds[big_step]["replicate"]
assert seconds[STEP_TOKENS[0]]["ragged"] < seconds[STEP_TOKENS[0]]["replicate"]
assert all(row["static"] >= row["ragged"] for row in seconds.values())

# %% [markdown]
# ### The compiled layer
#
# **Measure, as a TPU7x-8 would.** One MoE layer (`routing.moe_ep`, the same function the model calls),
# compiled for `tpu7x:2x2x1` with abstract weights, at the `qwen3.5-mini` width (`D = 512`, `k = 8`): the 397B
# width takes minutes per compile here; the formula is the same. XLA reports each collective with its shape.

# %%
mini = qwen35_lib.get_config("qwen3.5-mini", layout="dp8_ep8")
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None  # the 'tpu' extra
tpu_counts = {}
if HAVE_LIBTPU:
    tpu_mesh = aot.chip_core_mesh()
    for s, kw in STRATEGIES.items():
        counts = hlo.count(aot.compile_moe_layer(mini.replace(**kw), tpu_mesh, 512).as_text(), moved=True)
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
    want = traffic.layer_bytes(layer_ops(mini.replace(**kw), 512))
    assert {kind: v["bytes"] for kind, v in counts.items()} == want, (s, counts, want)
    assert {kind: v["count"] for kind, v in counts.items()} == (
        {"all-gather": 3, "reduce-scatter": 1} if kw["routing"] == "replicate" else {"all-to-all": 3})

# %%
Ns = [64, 256, 512, 2048, 8 * 2048]
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
for s, kw in STRATEGIES.items():
    ax.plot(Ns, [wire(big.replace(**kw), N) / 2**20 for N in Ns], marker="o", label=s)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens per step N (all 8 devices)")
ax.set_ylabel("MiB per device per MoE layer")
ax.set_title("Qwen3.5-397B: bytes on the wire per MoE layer (prediction; formula checked by the TPU7x compile)",
             fontsize=9)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 2. Dropping, counted
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
weights = qwen35_lib.init_weights(tiny, 0)
layer = jax.tree.map(lambda a: a[0, 0], weights["layers"]["moe"])  # the first MoE layer
r0 = np.asarray(layer["router"][:, 0])
rng = np.random.default_rng(0)
balanced = rng.standard_normal((64, tiny.hidden_size)).astype(np.float32)
skewed = balanced + 3.0 * r0 / np.linalg.norm(r0)  # every token leans towards expert 0

capped = {f: tiny.replace(routing="all_to_all", capacity_factor=f) for f in (1.0,)}
batches = {"balanced": balanced, "skewed": skewed}
ids = {name: route(tiny, layer["router"], jnp.asarray(x))[1] for name, x in batches.items()}  # [64, k] each
print({name: routing.predicted_drops(capped[1.0], i) for name, i in ids.items()})

# %% [markdown]
# **Measure.** `moe_ep` returns the number of dropped copies along with the output.

# %%
results = {}
for name, x in (("balanced", balanced), ("skewed", skewed)):
    results[name] = {s: routing.run_layer(tiny.replace(routing=r, capacity_factor=f), weights, x, mesh)
                     for s, (r, f) in {"replicate": ("replicate", None), "all_to_all": ("all_to_all", None),
                                       "all_to_all f=1": ("all_to_all", 1.0)}.items()}
    print(f"{name:<9} dropped copies: " + ", ".join(f"{s}: {d}" for s, (_, d) in results[name].items()))

# %% [markdown]
# **Check.** Dropless strategies drop nothing and equal the dense reference (every expert on every token,
# masked by the routing weights: `moe_dense_reference`, less its shared expert); the capped all-to-all drops
# exactly the predicted copies, more under skew.

# %%
for name, x in (("balanced", balanced), ("skewed", skewed)):
    ref = np.asarray(moe_dense_reference(tiny, layer, jnp.asarray(x)) - shared_expert(layer, jnp.asarray(x)))
    for s in ("replicate", "all_to_all"):
        out, dropped = results[name][s]
        assert dropped == 0
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert results[name]["all_to_all f=1"][1] == routing.predicted_drops(capped[1.0], ids[name])
assert results["skewed"]["all_to_all f=1"][1] > results["balanced"]["all_to_all f=1"][1]

# %% [markdown]
# ## 3. Determinism: does my answer depend on my neighbours?
#
# **Predict.** Replication computes every token's output from that token alone, whoever else is in the batch. A
# capped all-to-all gives buffer slots first come, first served on each device: a token whose device also carries
# tokens crowding the same experts loses some of its copies. Keep tokens 4-7 of every device's 8 the same, and make
# tokens 0-3 (which claim slots first) either balanced or skewed.

# %%
mixed = balanced.copy()
first_half = (np.arange(64) % 8) < 4
mixed[first_half] = skewed[first_half]
same_rows = ~first_half
changed = {}
for s, (r, f) in {"replicate": ("replicate", None), "all_to_all f=1": ("all_to_all", 1.0)}.items():
    alone, _ = results["balanced"][s]
    crowded, _ = routing.run_layer(tiny.replace(routing=r, capacity_factor=f), weights, mixed, mesh)
    changed[s] = int((np.abs(crowded[same_rows] - alone[same_rows]).max(axis=1) > 1e-6).sum())
    print(f"{s:<15} tokens (of {same_rows.sum()} unchanged ones) whose output changed: {changed[s]}")

# %% [markdown]
# **Check.** Replication: no token's output moves. The capped all-to-all: some do, for no fault of their own.

# %%
assert changed["replicate"] == 0 and changed["all_to_all f=1"] > 0

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
key = lambda name: re.sub(r"\W+", "_", name).strip("_")  # "all_to_all (f = 1.25)" -> "all_to_all_f_1_25"
record = dict(
    wire_bytes_397b={str(N): {key(s): wire(big.replace(**kw), N)
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

# %% [markdown]
# ## Exercises
#
# 1. **[Crossover]** For which top-`k` would an all-to-all with `f = 1.25` move fewer bytes than replication, at
#    `N = 512`?
#    <details><summary>Answer</summary>
#
#    Per device and per token of the step, replication moves about `2 · 7/8 · D·b` on the wire (the all-gather,
#    and the reduce-scatter's input), whatever `k`; the capped all-to-all only ships the device's own eighth of the
#    tokens, `k` copies each, there and back: `2 · 7/8 · f·k·D·b / 8`, linear in `k`. Compare
#    `wire(big.replace(routing=r, num_experts_per_tok=k, capacity_factor=f), 512)` (this notebook's `wire`, the
#    cost model's ops of one layer) for `k = 1 ... 10`: the capped all-to-all is cheaper up to `k = 6` and dearer
#    from `k = 7`. Qwen3.5's `k = 10` is past the crossover; without dropping (dropless buffers) it never wins.
#    </details>
#
# 2. **[How much capacity]** What capacity factor makes the skewed batch of section 2 drop nothing?
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
