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
# # 02 · The DP+EP hybrid: 8-way attention data parallelism, 8-way expert parallelism
#
# Notebook 01 ended with the fix the error message named: stop splitting attention by head, and split it by
# request. Each of the 8 devices runs attention and Gated DeltaNet for its own requests with whole heads, and the
# 512 experts are split 64 per device. Attention then needs no communication at all; the MoE does, because a
# token's 10 experts live on other devices: here each token is sent, by an **all-to-all**, to the devices that own
# its experts and its results come back the same way (the `dp_ep` stage of the ladder; chapter 3 asks whether
# that is the best way). This notebook asks: what lives where, which collectives does one layer run, what does
# the step buy over the baseline, and does the model still compute the same thing?

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/02_dp_ep_hybrid.ipynb)

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
# ## 0. What the step buys (the cost model, TPU7x-8)
#
# **Compute.** The `dp_ep` stage against the `baseline` (notebook 01), both workloads at 512 concurrent requests,
# milliseconds per 1,000 tokens served by component (`stage_gain`, over `costmodel.predict`).

# %%
from qwen35_lib.stage_gain import gain_table, stage_gain

stages = {"dp_ep": notebook.add_totals(stage_gain("dp_ep"))}  # + each workload's component total
print(gain_table(stages["dp_ep"]))

# %% [markdown]
# **Check.** With this library's XLA kernels, splitting requests costs throughput on both workloads. Attention gains:
# it reads each request's KV head once instead of once per copy, and XLA's attention, which reads up to its group's
# longest context for every decode token and every item of a prompt's tokens (notebook 01), now walks its own rank's
# tokens only. Each device also holds only its own rank's cache pools, updated in place under either layout
# (`cache`: 0 in both). But the MoE, most of the step, costs more: XLA's path moves `xla_tpu_fp8_expert_bytes` bytes
# for each FP8 parameter of a device's whole local experts under EP against `xla_tpu_fp8_expert_bytes_tp` for its
# slices of every expert under TP, as the two compiles have it; a device waits for its most loaded experts, and the
# eight ranks step in lockstep, each waiting for the busiest (the cost model's `expert_imbalance` and `dp_lockstep`
# mechanisms), which TP's split of every expert never sees; the all-to-all adds its own time. What the layout buys
# with XLA's kernels is the fit: the TP step is refused at the serving shape (notebook 01), this one fits (section 4);
# with the Pallas kernels it also pays in throughput (chapter 06).
# Decode-heavy steps carry a single new token per request, so the dense weights that every data-parallel device
# now reads whole (attention, GDN, the shared expert) weigh on them, and GDN costs more per token than under TP.
# What gives back most of attention's saving on the decode-heavy workload is the MoE, not GDN: the claims below
# check each of these comparisons on this run (`notebook.claim_*`), and the chapter states them from the records.

# %%
g = {wl: stages["dp_ep"][wl] for wl in ("8k/1k", "1k/8k")}
assert all(g[wl][k]["cache"] == 0 for wl in g for k in ("ms_per_1k_tokens", "previous_ms_per_1k_tokens"))  # in place
notebook.claim("xla_layout_costs", "with this library's XLA kernels splitting requests costs throughput on both "
               "workloads: {prefill:.2f}x the baseline's on 8k/1k, {decode:.2f}x on 1k/8k",
               g["8k/1k"]["gain"] < 1 and g["1k/8k"]["gain"] < 1, "gain < 1 on both",
               prefill=g["8k/1k"]["gain"], decode=g["1k/8k"]["gain"])
saved = g["1k/8k"]["saved_ms_per_1k_tokens"]
notebook.claim_largest("attention_saves_most", "on 1k/8k attention saves the most, {attention:.0f} ms per 1,000 "
                       "tokens", saved, "attention")
added = {k: -v for k, v in saved.items()}  # ms per 1,000 tokens each component adds
notebook.claim_largest("moe_gives_back_most", "what the decode-heavy step gives back is mostly the MoE's: it adds "
                       "{moe:.0f} ms per 1,000 tokens on 1k/8k, GDN {gdn:.0f}", added, "moe")
notebook.claim("moe_not_cheaper", "the MoE costs more per token under EP on both workloads "
               "({prefill:+.0%} on 8k/1k, {decode:+.0%} on 1k/8k)",
               all(g[wl]["component_change"]["moe"] > 0 for wl in g), "moe change > 0 on both",
               prefill=g["8k/1k"]["component_change"]["moe"], decode=g["1k/8k"]["component_change"]["moe"])
from qwen35_lib import data

facts = data.read_json("costmodel_hardware.json")["kernels"]
notebook.claim_greater("ep_expert_bytes_more", "as compiled, XLA's FP8 experts move {ep:.1f} B a parameter for a "
                       "device's whole local experts under EP against {tp:.1f} for its slices of every expert under TP",
                       ep=facts["xla_tpu_fp8_expert_bytes"]["value"], tp=facts["xla_tpu_fp8_expert_bytes_tp"]["value"])
assert all(g[wl]["component_change"]["attention"] < 0 for wl in g)
assert all(g[wl]["component_change"]["cache"] <= 0 for wl in g)  # fewer pools a device (none, with no copies)
assert g["1k/8k"]["component_change"]["gdn"] > 0

# %% [markdown]
# ## 1. What lives where
#
# In the notation of the playbook (`x` = both mesh axes, `('chip', 'core')`, 8 ways):
#
# | array | placement | per device (397B) |
# |---|---|---|
# | routed experts `W_gate_up[E_x, D, 2, F]`, `W_down[E_x, F, D]` | split by expert | 64 of 512 experts |
# | attention, GDN, shared expert, router, embeddings | replicated | all of them |
# | tokens in flight `x[B_x, D]` | split by request | 1/8 of the requests |
# | KV cache `kv[.., R_x, P, ps, 2·Hkv·d]`, GDN state `S[.., R_x, NS, Hv, dk, dv]` | by rank | own requests |
#
# The weight column is not typed from memory: `weight_notation` writes each weight from the PartitionSpec that
# `dp8_ep8` places it with, and the cell checks the table against it.

# %%
import qwen35_lib
from qwen35_lib.parallel.notation import weight_notation
from qwen35_lib.plan import get_layout

big = qwen35_lib.get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn", gdn_state_dtype="bfloat16")

ep_names = weight_notation(big, get_layout("dp8_ep8"), mesh)
for k in ("layers.moe.w_gate_up", "layers.moe.w_down", "layers.attn.w_q", "layers.gdn.w_v", "layers.moe.router",
          "embed"):
    print(f"{k:<22} {ep_names[k]}")
assert (ep_names["layers.moe.w_gate_up"], ep_names["layers.moe.w_down"]) == \
    ("W_gate_up[E_x, D, 2, F]", "W_down[E_x, F, D]")  # the table's first row
dense = [v for k, v in ep_names.items() if not k.startswith("layers.moe.w_")]
assert not any(sub in v for v in dense for sub in ("_x,", "_x]", "_chip", "_core")), dense  # replicated

# %% [markdown]
# <details><summary><b>Pop quiz.</b> Under `dp8_ep8`, which collectives does an attention or GDN layer need, and
# which does a MoE layer need?</summary>
#
# None for the mixers: a device holds all the attention and GDN weights and the whole cache of its own requests, so
# it computes them alone. A MoE layer must bring each token to the devices holding its experts and the results
# back: the next paragraph counts them.
# </details>
#
# **Predict.** Replicating the dense weights costs memory (7 extra copies of everything that is not a routed
# expert), but attention and GDN become purely local: no collective in the mixer. The MoE needs, per layer: each
# token sent once to every device that owns one of its experts (all-to-all), with those experts' ids and weights
# packed beside it (a second all-to-all), and the partial outputs sent home (a third).

# %%
from qwen35_lib.placement import fmt_range, placement

FP8_KV = "float8_e4m3fn"  # the serving KV cache

p = placement(big, "dp8_ep8", requests=512, context_len=8192 + 1024, kv_dtype=FP8_KV)
for d in (0, 1, 7):
    dev = p.per_device[d]
    print(f"device {d} (chip {dev.chip}, core {dev.core}): experts {fmt_range(dev.holds['experts'])}, "
          f"KV heads {fmt_range(dev.holds['kv_heads'])}, requests {fmt_range(dev.holds['requests'])}")
print(p.summary())

# %%
from qwen35_lib.viz.sharding_explorer import placement_figure

# figure: placement
placement_figure(p)

# %% [markdown]
# **Check.** 64 whole experts per device, both KV heads on every device, every 8th request.

# %%
assert all(len(d.holds["experts"]) == 64 and len(d.holds["kv_heads"]) == 2 for d in p.per_device)
assert sorted(r for d in p.per_device for r in d.holds["requests"]) == list(range(512))
assert p.fits

# %% [markdown]
# ### The middle ground: `dp4_tp2_ep8`
#
# Chapter 1's other way out keeps a little tensor parallelism: split attention's heads over the 2 cores of a chip
# (a KV head per core) and requests over the 4 chips, experts still over all 8 devices.
#
# <details><summary><b>Pop quiz.</b> Against `dp8_ep8`, does `dp4_tp2_ep8` hold more or fewer weight bytes per
# device, and more or fewer KV bytes?</summary>
#
# Fewer weight bytes: the attention and GDN weights are split over the two cores of a chip instead of copied to
# each. The same KV bytes: a core holds one of the 2 KV heads, but of twice as many requests (a quarter of them,
# not an eighth). The cell below prints both.
# </details>
#
# **Predict.** The dense
# weights are then stored once per chip instead of once per core; each core holds one KV head of a quarter of the
# requests, the same KV bytes per device as `dp8_ep8`; but attention and GDN need an all-reduce over `core` again
# in every layer.

# %%
mid = placement(big, "dp4_tp2_ep8", requests=512, context_len=8192 + 1024, kv_dtype=FP8_KV)
print(mid.summary())
d0 = mid.per_device[0]
print(f"device 0: experts {fmt_range(d0.holds['experts'])}, KV heads {fmt_range(d0.holds['kv_heads'])}, "
      f"requests {fmt_range(d0.holds['requests'])}")

# %% [markdown]
# **Check.** Fewer weight bytes per device than `dp8_ep8`, the same KV bytes, the same experts.

# %%
assert mid.weight_bytes_per_device < p.weight_bytes_per_device and mid.fits
assert abs(mid.kv_bytes_per_device - p.kv_bytes_per_device) <= 1e-3 * p.kv_bytes_per_device
assert all(len(d.holds["experts"]) == 64 and len(d.holds["kv_heads"]) == 1 for d in mid.per_device)

# %% [markdown]
# ## 2. Same model, same logits
#
# <details><summary><b>Pop quiz.</b> The tokens of one batch are now spread over 8 devices and their expert outputs
# summed after a round trip. In float32, how close to the single-device logits should the result be?</summary>
#
# Equal up to the order of summation: each token's output adds the same expert products, only in another order,
# so the difference is float32 rounding, far below anything that changes a greedy token. The check below bounds it.
# </details>
#
# **Predict.** Sharding changes where the work happens, not what is computed: the logits under `dp8_ep8` equal the
# single-device model's, in float32, up to summation order (each token adds the partial sums its experts'
# devices send back in its own order: differences of order 1e-6 relative at most).
#
# **Measure.** Nine prompts of different lengths, right-padded into one batch. The sharded forward is compiled
# once with `.lower(...).compile()` so that the same executable also gives us its HLO in section 3.

# %%
import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.parallel import shard_weights
from qwen35_lib.parallel.parallelism import lower_forward  # `forward`'s program, to compile and inspect
from qwen35_lib.plan import get_layout, get_stage

tiny = qwen35_lib.get_config("qwen3.5-tiny", dtype="float32")  # numeric checks: float32, seconds on a CPU
STAGE = get_stage("dp_ep")  # dp8_ep8 + all_to_all routing, XLA kernels
print(STAGE.layout, STAGE.routing, "|", get_layout(STAGE.layout).summary)
# Start section 3's TPU7x compile of the step now (~10 s), in a thread beside this section's CPU work.
import concurrent.futures
import importlib.util

from qwen35_lib import aot

step_cfg = qwen35_lib.get_config("qwen3.5-tiny", num_layers=8)  # the plan is STAGE: its XLA kernels on each
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None  # the 'tpu' extra
REQUESTS, DECODE = 16, 8
tpu_step = concurrent.futures.ThreadPoolExecutor(1).submit(
    lambda: aot.compile_step(step_cfg, STAGE, aot.chip_core_mesh(), requests=REQUESTS, context_len=256,
                             decode=DECODE).as_text()) if HAVE_LIBTPU else None

rng = np.random.default_rng(0)
lengths = np.array([3, 16, 7, 12, 1, 9, 16, 5, 11], np.int32)
ids = np.zeros((9, 16), np.int32)
for i, n in enumerate(lengths):
    ids[i, :n] = rng.integers(2, tiny.vocab_size, size=n)
weights = qwen35_lib.init_weights(tiny, 0)
dp_plan = STAGE.bind(mesh, tiny)  # the dp_ep stage (all-to-all routing), checked against the model and bound once
with jax.default_matmul_precision("highest"):
    reference = np.asarray(qwen35_lib.forward(tiny, weights, ids, lengths))  # one device
    with jax.set_mesh(mesh):
        sharded_weights = shard_weights(tiny, dp_plan, weights, mesh)
        forward_dp = lower_forward(tiny, sharded_weights, ids, lengths, dp_plan).compile()
        logits = np.asarray(forward_dp(sharded_weights, jnp.asarray(ids), jnp.asarray(lengths)))
mask = np.arange(16)[None, :] < lengths[:, None]  # real positions only
err = np.abs(logits - reference)[mask].max()
print(f"max |dp8_ep8 - single| over real positions: {err:.2e} (logits of size ~{np.abs(reference).max():.1f})")

# %% [markdown]
# **Check.**

# %%
np.testing.assert_allclose(logits[mask], reference[mask], rtol=1e-5, atol=1e-5)

# %% [markdown]
# ## 3. The collectives of one layer group, read from the compiled step
#
# <details><summary><b>Pop quiz.</b> How many collectives does one layer group of the `dp_ep` step hold, and of
# which kind?</summary>
#
# Twelve all-to-alls: three per MoE layer (tokens out, their expert ids and weights, partial outputs home) for the
# 4 MoE layers of a group, and nothing for the 3 GDN layers or the attention layer. The compiled HLO below says
# the same, and so does the cost model's closed form.
# </details>
#
# **Predict.** The decoder scans over layer groups (3 GDN layers + 1 attention layer, each followed by the MoE);
# the scan's loop body is one computation in the optimized HLO. Under `dp8_ep8` with `all_to_all` routing
# (dropless), one group should move, per MoE layer, with `n` tokens on each of the 8 devices, `c` rows per
# destination device (`routing.a2a_cap`: `n`, since a token goes at most once to each device), `k` experts per
# token and `b` bytes per activation:
#
# | collective | array | bytes (operand, per device) |
# |---|---|---|
# | all-to-all | token rows out `x[8, c, D]` | `8 · c · D · b` |
# | all-to-all | their local expert ids and weights, packed `[8, c, 2k]` int32 | `8 · c · 2k · 4` |
# | all-to-all | partial outputs home `{y[8, c, D]}_U` | `8 · c · D · b` |
#
# (`{y}_U`: each device's partial sum of a token's output over its own experts, *unreduced*: the token's home device
# adds the parts.) Nothing for attention or GDN: `4 x 3 = 12` all-to-alls per group. The same formulas are the cost
# model's (`costmodel.traffic.step_collectives`), which the next cell reads instead of retyping them. We compile the
# engine's step (`aot.compile_step`: abstract weights and caches, `DECODE` tokens per rank; 8 layers, i.e. 2
# groups, since XLA unrolls a scan of length 1) for this machine's 8 CPU devices and, with libtpu, for a TPU7x-8
# (`tpu7x:2x2x1`). Both in bf16, the serving dtype, with the XLA kernels of the `dp_ep` stage (Pallas kernels are
# notebook 05's subject).

# %%
from qwen35_lib.costmodel import StepShape, collective_counts
from qwen35_lib.costmodel.traffic import step_collectives
from qwen35_lib.parallel import hlo
from qwen35_lib.plan import make_mesh

# the step compiled for each target: here on the CPU mesh, and for TPU7x (started in section 2's first cell)
targets = {"CPU": lambda: aot.compile_step(step_cfg, STAGE, make_mesh(), requests=REQUESTS, context_len=256,
                                           decode=DECODE).as_text()}
if HAVE_LIBTPU:
    targets["TPU7x"] = tpu_step.result
else:
    print("libtpu not installed (pip install 'jax[tpu]'): skipped the TPU7x compile")
per_group, body_ops, step_ops = {}, {}, {}
for name, compiled_text in targets.items():
    text = compiled_text()
    body = hlo.layer_body(text)
    per_group[name] = hlo.count(text, body)
    body_ops[name] = [op for op in hlo.collectives(text) if op.computation in hlo.called(text, body)]
    step_ops[name] = hlo.collectives(text)
    print(f"{name}, one layer group: {per_group[name]}")
for name, ops in body_ops.items():
    for op in ops[:3]:
        print(f"  {name:<5} {op.kind:<12} {op.bytes:>6} B  {op.shape}")

# the cost model's closed form for the same step, per device, and the MoE ops of one group (4 layers of 8 run)
plan = STAGE.bind(make_mesh())
shape = StepShape.of_compile(step_cfg, plan.dp, REQUESTS, DECODE)
groups = step_cfg.num_layers // len(step_cfg.layer_pattern)
BACKEND = {"CPU": "cpu", "TPU7x": "tpu"}  # XLA:CPU widens 16-bit float collectives to float32
formula = {name: sorted(op.bytes for op in step_collectives(plan, step_cfg, shape, backend)
                        if op.part == "moe" for _ in range(op.runs // groups))
           for name, backend in BACKEND.items()}
print("cost model, one group's all-to-all bytes:", formula["TPU7x"])
print("cost model, the whole step per device {kind: (ops, bytes)}:",
      {k: v for k, v in collective_counts(plan, step_cfg, shape, "tpu").items() if v[0]})

# %% [markdown]
# **Check.** Both compilers keep the 12 all-to-alls per group, with the cost model's bytes (XLA:CPU carries bf16
# collectives in float32, so its token rows are doubled: the `cpu` backend of the formula says so). The layer body
# holds nothing else: the mixers are local. Outside it, the step's only collectives are the sampler's, as the cost
# model lists them: a 1-byte all-reduce of "is every row greedy" and the gather of the next tokens, an all-gather
# on the CPU and, as XLA's TPU compiler runs so small an array, an all-reduce of the assembled result on TPU7x
# (which also widens the flag to 4 bytes). No scalar all-reduce is left in the layers: the attention's page loop
# runs per device.

# %%
for name, ops in body_ops.items():
    assert per_group[name]["all-to-all"]["count"] == 12, (name, per_group[name])
    assert {op.kind for op in ops} == {"all-to-all"}, (name, {op.kind for op in ops})
    assert sorted(op.moved for op in ops) == formula[name], (name, sorted(op.moved for op in ops), formula[name])
    outside = sorted((op.kind, op.moved) for op in step_ops[name] if op not in ops)
    sampler = sorted((op.kind, op.bytes) for op in step_collectives(plan, step_cfg, shape, BACKEND[name])
                     if op.part == "sample")
    if name == "CPU":
        assert outside == sampler, (name, outside, sampler)
    else:  # XLA's TPU compiler: the flag widened to 4 bytes; the small gather an all-reduce, as the model lists it
        assert [kind for kind, _ in outside] == [kind for kind, _ in sampler] == ["all-reduce"] * 2, outside
        assert sorted(nbytes for _, nbytes in outside) == sorted(max(nbytes, 4) for _, nbytes in sampler), outside
    print(f"{name} outside the layer body: {outside}")

# %% [markdown]
# **The 397B step, compiled for TPU7x.** The stored sweep (`data/aot/tpu7x-8.json`, `make sweep`) holds the `dp_ep`
# stage's engine step at the serving shape: full depth, 512 requests (64 sequences a rank), every request's whole
# context in an FP8 pool, FP8 experts. **Check:** every all-to-all of its 60 MoE layers is there with the cost
# model's bytes, no other collective but the sampler's, and the step fits the device with the headroom printed.

# %%
from qwen35_lib import data as data_files
from qwen35_lib.report import human_bytes

stored = data_files.read_json("aot/tpu7x-8.json")
for step in ("8k/1k decode", "8k/1k mixed"):
    e = stored["stages"]["dp_ep"]["steps"][step]
    a2a = e["collectives"]["all-to-all"]
    print(f"dp_ep {step:<13} all-to-alls {a2a['count']} ({human_bytes(a2a['bytes'])}; cost model "
          f"{a2a['model_count']}, {human_bytes(a2a['model_bytes'])}); total {human_bytes(e['total_bytes'])} per "
          f"device, {human_bytes(e['headroom_bytes'])} to spare")
    assert a2a["count"] == a2a["model_count"] == 3 * big.num_layers and a2a["bytes"] == a2a["model_bytes"], a2a
    assert set(k for k, v in e["collectives"].items() if v["count"]) <= {"all-to-all", "all-reduce"}, e["collectives"]
    assert e["fits"] and e["total_bytes"] + e["headroom_bytes"] == stored["usable_bytes"]
sweep_dp_ep = {step.split()[1]: {k: stored["stages"]["dp_ep"]["steps"][step][k]
                                 for k in ("total_bytes", "temp_bytes", "headroom_bytes", "fits")}
               for step in ("8k/1k decode", "8k/1k mixed")}
kernels_temp = stored["stages"]["kernels"]["steps"]["8k/1k decode"]["temp_bytes"]  # the same step, the Pallas kernels
notebook.claim_greater("kernels_temporaries_smaller", "the `kernels` stage's decode step, whose Pallas kernels read "
                       "weights and caches where they lie, needs {kernels:.2f} GiB of temporaries, under a tenth of "
                       "`dp_ep`'s {dp_ep:.2f} GiB", factor=10.0, dp_ep=sweep_dp_ep["decode"]["temp_bytes"] / 2**30,
                       kernels=kernels_temp / 2**30)

# %% [markdown]
# ## 4. Any number of requests
#
# The engine sends each new request to the least-loaded of the 8 data-parallel ranks; each rank has its own page
# and slot pools, on its own device. A single request leaves 7 ranks idle (they run padding); one request more
# than there are ranks puts two on one rank (one prefill chunk of `max_num_batched_tokens` per rank per step: its
# second request waits a step).
#
# <details><summary><b>Pop quiz.</b> Does a request's first token depend on how many other requests share the
# engine (1, 3 or 9)?</summary>
#
# No: every rank runs its own requests' attention, and the MoE's all-to-all returns each token's own expert
# outputs, so a request's numbers are its own whatever its neighbours. The cells below check it for each count.
# </details>
#
# **Predict:** the first generated token of each request is the argmax of the
# single-device logits at its last prompt position.

# %%
from qwen35_lib.engine import Engine, EngineConfig
from qwen35_lib.engine.sampling import SamplingParams

engine = Engine(tiny, weights, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                mesh=mesh, plan=STAGE)
prompts = [list(ids[i, :n]) for i, n in enumerate(lengths)]
expected = reference[np.arange(9), lengths - 1].argmax(-1)
first = {}
with jax.default_matmul_precision("highest"):
    for n in (1, 3, 9):
        out = engine.generate(prompts[:n], SamplingParams(max_new_tokens=1, ignore_eos=True))
        first[n] = [r.output_ids[0] for r in out]
        print(f"{n} request(s): first tokens {first[n]}; expected {expected[:n].tolist()}")
print(f"{engine.ec.ranks} ranks, engine steps {engine.stats.steps}, "
      f"compiled step shapes {sorted(engine.stats.buckets)}")

# %% [markdown]
# **Check.**

# %%
for n, tokens in first.items():
    assert tokens == expected[:n].tolist(), (n, tokens)

# %% [markdown]
# ## 5. Which layout wins, by concurrency
#
# Everything so far was told at 512 concurrent requests. Production does not serve every load one way: tpu-inference's
# Qwen3.5 sweep runs attention tensor-parallel (`TP8_EP`: the 2 KV heads duplicated, experts over all 8 devices) at
# concurrency 4 and 8, `DP4TP2_EP` at 16 and 32, and `DP8_EP` from 64 on 8k/1k (its `SHARDING_TABLE`, PRs #3079 and
# #3116). Why would the layout this chapter built lose at low load?
#
# <details><summary><b>Pop quiz.</b> At 4 concurrent decodes, how many times more bytes of attention and GDN weights
# does `dp8_ep8` read per step than `tp8_ep8`? And at 512, how many times more KV bytes does `tp8_ep8` read?</summary>
#
# As many times as there are data-parallel devices: each reads its own whole copy of the dense weights, for only the
# few requests it holds, where tensor parallelism reads one copy split over all of them. The other way, by the KV
# heads' duplication: tensor parallelism gives each device one KV head of every request (each head read by several
# devices), data parallelism both heads of its own share of the requests.
# </details>
#
# **Predict.** At low concurrency the step is all weight reads, and `dp8_ep8` pays them once per device: tensor
# parallelism should win. As concurrency grows, weights are read once for more tokens, while tensor parallelism's
# duplicated KV reads and its per-layer all-reduces of activations grow with the tokens: the margin should shrink.
#
# **Compute.** `costmodel.choice.table` prices every layout at each concurrency (`python -m qwen35_lib.costmodel
# layouts --engine tpu-inference --kernels pallas`), here as tpu-inference's engine runs them (the engine the
# published table was measured on; Pallas kernels) and set as its sweep set each layout (`setup="tpu-inference"`:
# server.sh at the commit of the table, at the layout's own DP size: per rank min(max(ISL / DP, 1024), 2048) tokens a
# step and 2 x CONC / DP sequences, the settings `recipe` emits; at 8k/1k `tp8_ep8`'s one rank thus steps fewer
# tokens than the DP layouts' ranks together); `layout_mechanisms` splits a layout's milliseconds per 1,000 tokens by
# the mechanism that separates them.

# %%
import matplotlib.pyplot as plt

from qwen35_lib.costmodel import choice

lay_table = choice.table(isl=8192, osl=1024, kernels="pallas", engine="tpu-inference")
print(choice.format_table(lay_table))
picked = {row["concurrency"]: row["picked"] for row in lay_table["rows"]}
CONC_INDEX = {row["concurrency"]: i for i, row in enumerate(lay_table["rows"])}
tput = {row["concurrency"]: {c["layout"]: c["total_tokens_per_s"] for c in row["candidates"] if c["fits"]}
        for row in lay_table["rows"]}
lay_costs = {c: choice.layout_mechanisms(concurrency=c) for c in (4, 512)}
for c, rows in lay_costs.items():
    print(f"c{c}: ms per 1,000 tokens")
    for layout, parts in rows.items():
        print(f"  {layout:<12} " + "  ".join(f"{k} {v:6.2f}" for k, v in parts.items()))

# %% [markdown]
# Beside it, the published table: the layout tpu-inference's sweep serves at each point and the total tokens/s its
# PR reports (data/published.json, judging data: no prediction reads it).

# %%
published_table = data_files.read_json("published.json")["sharding_table"]
presets = published_table["presets"]
pub = [r for r in published_table["rows"] if (r["isl"], r["osl"]) == (8192, 1024)]
print(f"{'conc':>5} {'published':<10} {'as named here':<13} {'published tok/s':>15}  {'model picks':<12} "
      f"{'model tok/s (that preset)':>25}")
for r in pub:
    c, lay = r["concurrency"], presets[r["sharding"]]
    print(f"{c:>5} {r['sharding']:<10} {lay:<13} {r['total_tokens_per_s']:>15,.0f}  {picked[c]:<12} "
          f"{tput[c][lay]:>25,.0f}")

# figure: layouts_by_concurrency
fig, ax = plt.subplots(figsize=(6.4, 3.8))
concs = [row["concurrency"] for row in lay_table["rows"]]
for layout in lay_table["layouts"]:
    ax.plot(concs, [tput[c].get(layout, float("nan")) for c in concs], "o-", ms=3, label=f"{layout} (model)")
ax.scatter([r["concurrency"] for r in pub], [r["total_tokens_per_s"] for r in pub], marker="s", color="black",
           zorder=3, label="published (its preset)")
for r in pub:
    ax.annotate(r["sharding"], (r["concurrency"], r["total_tokens_per_s"]), textcoords="offset points",
                xytext=(4, -10), fontsize=7)
ax.set_xscale("log", base=2)
ax.set_xlabel("concurrent requests (8k/1k)")
ax.set_ylabel("total tokens/s (TPU7x-8)")
ax.set_title("Each layout priced over concurrency, as tpu-inference runs it")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# **Explore.** Where each layout's time goes at any concurrency: move the slider (the widget needs a live kernel; the
# bars printed above it are the same view at concurrency 64). `choice.layout_mechanisms` is the function behind both.

# %%
from IPython.display import display

from qwen35_lib.viz import costmodel as viz_cm

view_text, view_fig = viz_cm.layouts_view(concurrency=64)
print(view_text)
display(view_fig)
try:
    import ipywidgets  # noqa: F401

    display(viz_cm.layouts_explorer())
except ImportError:
    print("ipywidgets not installed: call viz_cm.layouts_view(concurrency=...) directly")

# %% [markdown]
# **Check.** The claims below hold the reasons, not the numbers: which layout wins at the low end, what each pays
# for, and where the model's pick and the published table part.

# %%
tp_layouts = ("tp8_kvrep", "tp8_ep8")
low, high = lay_costs[4], lay_costs[512]
notebook.claim("layouts_tp_at_c4", "at 4 concurrent requests the model serves {pick}, a layout with attention "
               "split by head", picked[4] in tp_layouts, "pick in (tp8_kvrep, tp8_ep8)", pick=picked[4])
notebook.claim_greater("layouts_dense_weights_c4", "at 4 requests dp8_ep8 spends {dp:.0f} ms per 1,000 tokens "
                       "reading the dense weights, more than 4x tp8_ep8's {tp:.0f} (every rank reads its whole copy)",
                       factor=4.0, dp=low["dp8_ep8"]["dense weights"], tp=low["tp8_ep8"]["dense weights"])
notebook.claim_greater("layouts_kv_c512", "at 512 requests tp8_ep8 spends {tp:.2f} ms per 1,000 tokens reading KV "
                       "heads, more than twice dp8_ep8's {dp:.2f} (each of the 2 heads is read on 4 devices)",
                       factor=2.0, tp=high["tp8_ep8"]["KV reads"], dp=high["dp8_ep8"]["KV reads"])
notebook.claim_greater("layouts_collectives_c512", "and its activation all-reduces, {tp:.2f} ms per 1,000 tokens, "
                       "cost more than dp8_ep8's all-gathers and reduce-scatters ({dp:.2f})",
                       tp=high["tp8_ep8"]["collectives"], dp=high["dp8_ep8"]["collectives"])
r4, r512 = tput[4]["tp8_ep8"] / tput[4]["dp8_ep8"], tput[512]["tp8_ep8"] / tput[512]["dp8_ep8"]
notebook.claim("layouts_margin_falls", "tp8_ep8's throughput over dp8_ep8's falls from x{r4:.2f} at 4 requests to "
               "x{r512:.2f} at 512", r4 > 1.5 > 1 > r512, "r4 > 1.5 and r512 < 1", r4=r4, r512=r512)
notebook.claim("layouts_agree_low", "at 4 and 8 requests the model's pick ({c4}, then {c8}) splits attention by "
               "head, as the published TP8_EP does", all(picked[c] in tp_layouts for c in (4, 8)),
               "picks at c4 and c8 in (tp8_kvrep, tp8_ep8)", c4=picked[4], c8=picked[8])
apart = [r for r in pub if r["concurrency"] >= 16 and picked[r["concurrency"]] != presets[r["sharding"]]]
notebook.claim("layouts_disagree_high", "from 16 to 256 requests the model's pick differs from the published preset "
               "at {n} of {m} points ({which}), and from 128 requests on it serves dp8_ep8 as the table does",
               bool(apart) and all(picked[c] == "dp8_ep8" for c in (128, 256, 512)),
               "some pick differs from the preset at c16-c256, and the pick is dp8_ep8 at c128-c512",
               n=len(apart), m=sum(r["concurrency"] >= 16 for r in pub),
               which=", ".join(f"c{r['concurrency']} {picked[r['concurrency']]}" for r in apart))
gaps_apart = {c: 1 - tput[c][presets[r["sharding"]]] / max(tput[c].values())
              for r in apart for c in (r["concurrency"],)}
notebook.claim("layouts_agree_mid", "set as the sweep set each layout, the model's pick at 32 requests is the "
               "published DP4TP2_EP ({c32}); where the two part, the published preset is priced at most {gap:.1%} "
               "behind the pick, under a tenth", picked[32] == "dp4_tp2_ep8" and max(gaps_apart.values()) <= 0.10,
               "pick at c32 == dp4_tp2_ep8, every published preset within 10% of the pick where they differ",
               c32=picked[32], gap=max(gaps_apart.values()))
behind = {c: tput[c]["dp8_ep8"] / max(tput[c].values()) for c in (64, 128, 256, 512)}
notebook.claim("layouts_dp8_close", "the published DP8_EP is priced x{lo:.2f} to x{hi:.2f} of the pick "
               "from 64 to 512 requests, closer the more requests", 0.9 <= min(behind.values())
               and list(behind.values()) == sorted(behind.values()), "0.9 <= dp8_ep8 / pick, rising with concurrency",
               lo=min(behind.values()), hi=max(behind.values()))
at_preset = [tput[r["concurrency"]][presets[r["sharding"]]] / r["total_tokens_per_s"] for r in pub
             if r["concurrency"] >= 16]
notebook.claim("layouts_presets_within_25", "priced under the published preset, every point from 16 to 256 "
               "requests is within 25% of what #3079 measured after its changes (x{lo:.2f} to x{hi:.2f})",
               all(0.75 <= x <= 1.25 for x in at_preset), "0.75 <= model / published <= 1.25 at c16-c256",
               lo=min(at_preset), hi=max(at_preset))
from qwen35_lib.costmodel import validate

points_3050 = [r for r in validate.layout_points() if (r["isl"], r["osl"]) == (8192, 1024)
               and r["layout"] == "dp4_tp2_ep8"]  # #3050's DP4TP2_EP rows
early = [r["ratio"] for r in points_3050]
by_conc = [r["ratio"] for r in sorted(points_3050, key=lambda r: r["concurrency"])]
notebook.claim("layouts_3050_within", "#3050's earlier DP4TP2_EP runs at 4 to 32 requests, before #3079's changes, "
               "are priced x{lo:.2f} to x{hi:.2f} what they measured: within 25%",
               all(0.75 <= x <= 1.25 for x in early), "0.75 <= model / published <= 1.25 at each point",
               lo=min(early), hi=max(early))
gaps = [r["predicted_median_tpot_ms"] - r["measured_median_tpot_ms"] for r in points_3050]
notebook.claim("layouts_tpot_close", "and at each of them the model's median TPOT is within {gap:.1f} ms of the "
               "measured one ({lo:+.1f} to {hi:+.1f} ms)", max(map(abs, gaps)) < 1.0, "every |gap| < 1 ms",
               gap=max(map(abs, gaps)), lo=min(gaps), hi=max(gaps))
tpot4 = {c["layout"]: c["median_tpot_s"] * 1e3 for c in lay_table["rows"][CONC_INDEX[4]]["candidates"] if c["fits"]}
notebook.claim("layouts_tp_shortest_steps", "at 4 requests tp8_ep8's steps are the shortest of the four layouts "
               "(median TPOT {tp8_ep8:.1f} ms, dp8_ep8's {dp8_ep8:.1f})", min(tpot4, key=tpot4.get) == "tp8_ep8",
               "tp8_ep8 has the least median TPOT of the layouts", **tpot4)
tp4 = next(r for r in pub if r["concurrency"] == 4)
c4_ratio = tput[4]["tp8_ep8"] / tp4["total_tokens_per_s"]
notebook.claim("layouts_c4_within", "at 4 requests the model prices tp8_ep8 at {model:,.0f} tokens/s against the "
               "{published:,.0f} #3116 measured (x{ratio:.2f}), within 25% too", 0.75 <= c4_ratio <= 1.25,
               "0.75 <= model / published <= 1.25", model=tput[4]["tp8_ep8"], published=tp4["total_tokens_per_s"],
               ratio=c4_ratio)
this_c4 = choice.choose(isl=8192, osl=1024, concurrency=4, kernels="pallas", roofline=False)["layout_choice"]
notebook.claim("layouts_this_engine_c4", "priced as this library's engine, the c4 pick is {pick} too",
               this_c4["picked"] in tp_layouts, "pick in (tp8_kvrep, tp8_ep8)", pick=this_c4["picked"])
notebook.save_results("layouts", dict(table=lay_table, mechanisms=lay_costs, published=pub,
                                      picked={str(c): v for c, v in picked.items()}))

# %% [markdown]
# **What a step costs that the roofline does not** (issue 55; read from the sources, nothing set from these points). Not
# the sampler: the benchmark client (InferenceX's `utils/bench_serving/backend_request_func.py`) sends `temperature:
# 0.0`, so tpu-inference's `sample()` takes the argmax and its top-k / top-p binary searches never run. Not host work
# that async scheduling hides: tpu-inference's runner (`tpu_runner.py` at d134ed202) dispatches step i + 1 before it
# waits for step i's tokens (`_modify_prev_results` in `_sample_from_logits`), so host work shorter than a step costs
# nothing and host work longer than a step would set the step, not add a fixed time to it. Not the collectives' start as
# the model prices it: small collectives inside a TPU program take a few microseconds (marin-community/marin#6736,
# `ppermute` on v5p and v6e), what the model already charges. It is device time below the roofline: the fixed start of a
# layer's kernels, layer after layer. Two parts have a public figure. tpu-inference #2671 measures its GDN path per
# layer over a range of decode batches, and its times do not fall to zero with the tokens, so the model charges their
# intercept, `gdn_layer_fixed_s`, to every GDN layer of every step. The public device-time benchmark of its MoE layer
# records each cell's grouped-matmul kernels apart from the whole layer, and the time outside the kernels has a part a
# call, `moe_layer_fixed_s`, beside a part a routed row (both set from the five smallest cells; values and ranges in
# `data/costmodel_assumptions.json`). The attention layers' and the dense projections' fixed starts, and the small
# programs dispatched around the forward (tpu-inference #3237 removes some), have none and stay unpriced.

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> A layout is a price per load: at a few requests the step is weight reads and data parallelism
# pays them once per rank; at hundreds the duplicated KV heads and the activation all-reduces of tensor parallelism
# are what grow.
# </div>

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(placement_397b=dict(weight_bytes=p.weight_bytes_per_device, kv_bytes=p.kv_bytes_per_device,
                                  gdn_state_bytes=p.gdn_state_bytes_per_device,
                                  total_bytes=p.total_bytes_per_device, fits=p.fits),
              placement_dp4_tp2_ep8=dict(weight_bytes=mid.weight_bytes_per_device, kv_bytes=mid.kv_bytes_per_device,
                                         total_bytes=mid.total_bytes_per_device, fits=mid.fits),
              kv_dtype=FP8_KV, stage=STAGE.name, routing=STAGE.routing,
              logits_max_abs_err=float(err), collectives_per_group=per_group,
              first_tokens={str(k): v for k, v in first.items()}, stages=stages, sweep=sweep_dp_ep)
notebook.save_results("dp_ep", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> Splitting requests for attention and experts for the MoE makes the mixers communication-free
# and leaves three all-to-alls per MoE layer (tokens out, their ids and weights, results home), at the price of
# replicating the dense weights on every device, which with FP8 experts and an FP8 KV cache still fits 512
# requests of 9,216 tokens, a request's whole context.
# </div>
#
# ## What we learned
#
# - Split attention by request and the MoE by expert: the mixers then need no collective at all, and the KV factor
#   of chapter 1 is gone.
# - The price is memory: every device holds a copy of every dense weight. FP8 experts and an FP8 KV cache make
#   room for it; `dp4_tp2_ep8` trades some of it back for an all-reduce over `core` in every layer.
# - The MoE's collectives can be counted three ways that must agree: by hand, by the cost model's closed form, and
#   in the compiled HLO for the CPU and for TPU7x.
# - A request's tokens do not depend on its neighbours: the engine's data-parallel ranks and the all-to-all keep
#   each request's numbers its own.

# %% [markdown]
# ## Exercises
#
# 1. **[The price of replication]** How many bytes per device does `dp8_ep8` spend on weights that are not routed
#    experts, and what would `dp4_tp2_ep8` save?
#    <details><summary>Answer</summary>
#
#    `p.per_device[0].weight_bytes_by_part` splits the weights by part; compare with
#    `placement(big, "dp4_tp2_ep8").per_device[0].weight_bytes_by_part`: attention and GDN weights halve (their
#    heads are split over `core`), the embeddings and shared expert stay replicated.
#    </details>
#
# 2. **[Where the bytes go]** In section 3, which all-to-all is the smallest, and why is it so much smaller than
#    the other two?
#    <details><summary>Answer</summary>
#
#    `body_ops["CPU"]` lists them with their shapes: the token rows and the partial outputs `[8, c, D]` carry `D`
#    values per row, the packed ids and weights `[8, c, 2k]` only `2k` each.
#    </details>
#
# 3. **[Uneven ranks]** With one request more than ranks, one rank holds two. What does that cost the other 7
#    ranks in a step?
#    <details><summary>Answer</summary>
#
#    Every rank runs the same compiled step shape (`engine.stats.buckets`): the ranks with one request compute
#    padding for the second slot. Balanced admission (the least-loaded rank first) keeps that to one slot.
#    </details>
#
# 4. **[Routing by replication]** Compile the step under `STAGE.replace(routing="replicate")` and count the
#    collectives of one layer group again. What replaces the all-to-alls?
#    <details><summary>Answer</summary>
#
#    Per MoE layer, three all-gathers (hidden states, top-k ids, top-k weights: every device sees every token) and
#    one reduce-scatter of the partial outputs; notebook 03 compares the two strategies.
#    </details>

# %% [markdown]
# **The answers, computed.** Each exercise's numbers, from this run, folded until you open them.

# %%
mid = placement(big, "dp4_tp2_ep8", requests=512, context_len=8192 + 1024, kv_dtype=FP8_KV)
dense = {k: v for k, v in p.per_device[0].weight_bytes_by_part.items() if k != "routed experts"}
dense_mid = {k: v for k, v in mid.per_device[0].weight_bytes_by_part.items() if k != "routed experts"}
notebook.answer(1, "{d:.2f} GiB a device of weights that are not routed experts under dp8_ep8, {m:.2f} GiB under "
                "dp4_tp2_ep8: it saves {saved:.2f} GiB a device.", d=sum(dense.values()) / 2**30,
                m=sum(dense_mid.values()) / 2**30, saved=(sum(dense.values()) - sum(dense_mid.values())) / 2**30)
a2a = sorted({op.bytes for op in body_ops["CPU"] if op.kind == "all-to-all"})
notebook.answer(2, "the packed ids and weights: {small:,} bytes against {large:,} for the token rows and outputs "
                "(on the CPU compile), {ratio:.0f}x fewer: 2k values a row against D.", small=a2a[0], large=a2a[-1],
                ratio=a2a[-1] / a2a[0])
ranks, requests_ = 8, 8 + 1
slots = ranks * -(-requests_ // ranks)  # every rank runs the same step shape: the busiest rank's
notebook.answer(3, "{slots} request slots run for {n} requests: {pad} of them padding, {frac:.0%} of the step, on "
                "the {idle} ranks that hold one request.", slots=slots, n=requests_, pad=slots - requests_,
                frac=(slots - requests_) / slots, idle=ranks - 1)
rep_counts = collective_counts(get_stage("replicate").bind(make_mesh()), step_cfg, shape, "tpu")
notebook.answer(4, "per step {ag} all-gathers and {rs} reduce-scatters (the cost model's count for the same step), "
                "{a2a} all-to-alls: {per} all-gathers and {rs_layer} reduce-scatter a MoE layer.",
                ag=rep_counts.get("all-gather", (0, 0))[0], rs=rep_counts.get("reduce-scatter", (0, 0))[0],
                a2a=rep_counts.get("all-to-all", (0, 0))[0],
                per=rep_counts.get("all-gather", (0, 0))[0] // step_cfg.num_layers,
                rs_layer=rep_counts.get("reduce-scatter", (0, 0))[0] // step_cfg.num_layers)
