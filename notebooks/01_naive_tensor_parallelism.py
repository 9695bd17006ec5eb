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
# # 01 · Naive tensor parallelism: why 8-way TP breaks on 2 KV heads
#
# The textbook way to put one model on 8 devices is tensor parallelism: split every weight matrix along its
# heads (or its FFN columns) 8 ways, and all-reduce the partial sums. Qwen3.5-397B-A17B has 32 query heads, which
# split fine, but only **2 KV heads**: 2/8 = 0.25 of a head per device. This notebook asks what that breaks, what
# the usual patch (give every device a copy of the KV head its query heads read) costs in KV-cache memory and in
# the bytes every decode step reads, and what the patched layout, the **baseline** of the ladder, serves on a
# TPU7x-8 at 512 concurrent requests, with the FP8 KV cache the serving configuration uses.

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/01_naive_tensor_parallelism.ipynb)

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
# ## 0. What the baseline serves (the cost model, TPU7x-8)
#
# **Compute.** `tp8_kvrep` with XLA's kernels is the `baseline` stage of the ladder, the first rung every later
# chapter improves on. The cost model (`qwen35_lib.costmodel.predict`, through `stage_gain`) plays the two
# workloads at 512 concurrent requests on a TPU7x-8 and splits the time of the slice by component, in
# milliseconds per 1,000 tokens served (input + output): the components sum to one over the throughput.

# %%
from qwen35_lib.stage_gain import gain_table, stage_gain

stages = {"baseline": notebook.add_totals(stage_gain("baseline"))}  # + each workload's component total
print(gain_table(stages["baseline"]))

# %% [markdown]
# **Check.** Each comparison the chapter makes is a claim this run checks (`notebook.claim_*`: it prints the sentence,
# records it for the chapter, and fails the notebook when it does not hold). On both workloads the routed experts are
# the baseline's largest cost: under TP every device reads a slice of *every* expert's weights for every step,
# whichever experts its tokens chose, and XLA's path moves `xla_tpu_fp8_expert_bytes_tp` bytes for each FP8 parameter
# as compiled (the slice copied, relaid out and dequantized to bf16 before the matmul reads it). Attention comes
# second: under TP every device reads every request's KV (the 2 KV heads replicated), and XLA's paged attention walks
# the pages a group at a time (decode tokens, or items of `ITEM_BLOCK` prompt tokens, sorted by context in groups of
# `WALK_ROWS`), so each row reads up to its group's longest context, near its own; the compiled walk keeps a group's
# gathered pages and scores in VMEM and moves `xla_tpu_paged_attention_bytes` bytes of HBM traffic for each FP8 value
# it reads (`costmodel.compiled` reads it off the TPU7x compile). A vectorized XLA loop cannot stop early for one
# row; the Pallas kernel of chapter 05 reads each sequence's own pages once, in FP8. The decode-heavy workload spends
# more per token than the prefill-heavy one, since each decode step reads the expert weights for one token per
# request. The components sum to the whole step: their milliseconds per 1,000 tokens add up to one over the
# throughput.

# %%
ms = {wl: stages["baseline"][wl]["ms_per_1k_tokens"] for wl in ("8k/1k", "1k/8k")}
largest = "on {wl} the MoE is the baseline's largest cost, {moe:.0f} ms per 1,000 tokens, against {attention:.0f} " \
    "for attention"
second = "on {wl} attention comes second ({attention:.0f} ms per 1,000 tokens; GDN {gdn:.0f})"
notebook.claim_largest("moe_largest_8k1k", largest, ms["8k/1k"], "moe", wl="8k/1k")
notebook.claim_largest("moe_largest_1k8k", largest, ms["1k/8k"], "moe", wl="1k/8k")
rest = {wl: {k: v for k, v in ms[wl].items() if k != "moe"} for wl in ms}
notebook.claim_largest("attention_second_8k1k", second, rest["8k/1k"], "attention", wl="8k/1k")
notebook.claim_largest("attention_second_1k8k", second, rest["1k/8k"], "attention", wl="1k/8k")
notebook.claim_greater("decode_costs_more", "the decode-heavy workload costs more per token: {decode:.0f} ms per "
                       "1,000 tokens against {prefill:.0f} for the prefill-heavy one",
                       decode=sum(ms["1k/8k"].values()), prefill=sum(ms["8k/1k"].values()))

# %% [markdown]
# ## 1. Heads per device
#
# <details><summary><b>Pop quiz.</b> Split every head axis of Qwen3.5-397B over the 8 devices: its query heads, KV
# heads, GDN value heads and experts. Which split leaves a device holding part of a head?</summary>
#
# The KV heads. There are 2 of them for 8 devices, so each device would get a quarter of a head, and a head cannot
# be cut: K and V of a head are whole vectors per token. Every other axis divides (the cell below prints each
# ratio).
# </details>
#
# **Predict.** Tensor parallelism over all 8 devices (`('chip', 'core')`, written `x` below) gives every device
# `1/8` of each head axis: attention weights `W_q[D, Hq_x]`, `W_k[D, Hkv_x]`, the expert FFN `W[E, D, F_x]`. A
# device can only compute attention for *whole* KV heads: K and V of a head are one vector per token, and a query
# head attends against exactly one of them. So the split must give an integer.
#
# > **Notation.** An array is written with a letter per dim: `W_down[E, F, D]` is experts x expert FFN x hidden,
# > `x[B, D]` requests x hidden. A dim split over mesh axes carries them as a subscript: `_x` for both axes
# > `('chip', 'core')`, `_chip` across the chips, `_core` across the two TensorCores of a chip; a dim without one
# > is whole on every device. `{y[N, D]}_U` is a partial sum that still has to be added up over the devices
# > (*unreduced*). `qwen35_lib.parallel.notation` writes any placed array so, from the PartitionSpec that places
# > it; the weights below are the 397B model's as `tp8_kvrep` places them (dims without a name by their size).

# %%
from jax.sharding import PartitionSpec

import qwen35_lib
from qwen35_lib.parallel.notation import notation, weight_notation
from qwen35_lib.plan import get_layout

big = qwen35_lib.get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn", gdn_state_dtype="bfloat16")

tp_names = weight_notation(big, get_layout("tp8_kvrep"), mesh)
for k in ("layers.attn.w_q", "layers.attn.w_k", "layers.moe.w_gate_up", "layers.moe.w_down"):
    print(f"{k:<22} {tp_names[k]}")
print(f"{'tokens in flight':<22} {notation('x', ('B', 'D'), PartitionSpec())}")

# %%
# numeric checks: float32, seconds on a CPU; 8 query heads on 2 KV heads, so a KV head serves 4 query heads and
# tp8_kvrep can give each device a copy of its own one, as at the 397B size (32 on 2)
tiny = qwen35_lib.get_config("qwen3.5-tiny", dtype="float32", num_q_heads=8)

for c in (big, tiny):
    print(f"{c.name:<18} query heads {c.num_q_heads:>2}/8 = {c.num_q_heads / 8:<5g} KV heads {c.num_kv_heads}/8 = "
          f"{c.num_kv_heads / 8:<5g} GDN value heads {c.gdn_num_v_heads}/8 = {c.gdn_num_v_heads / 8:<5g} "
          f"experts {c.num_experts}/8 = {c.num_experts / 8:g}")

# %% [markdown]
# **Measure.** Binding a plan to a mesh (`plan.bind(mesh, config)`) checks it against the model: every entry point
# (the engine, the checkpoint loader, the ahead-of-time compile) binds once before placing anything. Bind `tp8`.

# %%
from qwen35_lib.placement import placement
from qwen35_lib.plan import get_layout

try:
    get_layout("tp8").bind(mesh, tiny)
    refusal = None
except ValueError as e:
    refusal = str(e)
print(refusal)
print("why:", placement(big, "tp8").why)

# %% [markdown]
# **Check.** The layout is refused, and the message names both ways out: give each device whole heads of *other
# requests* (data parallelism, `dp8_ep8`, notebook 02), or keep tensor parallelism and replicate the KV heads.

# %%
assert refusal is not None and "2 KV heads cannot be split over 8 devices" in refusal
assert "'dp8_ep8'" in refusal and "'tp8_kvrep'" in refusal

# %% [markdown]
# ## 2. The patch: a copy of the KV head per device (`tp8_kvrep`)
#
# `tp8_kvrep` splits everything `tp8` splits and duplicates each KV head `r = 8 / Hkv` times in the weights
# (`plan.kv_replication`), so that the `Hkv · r` heads split evenly over the 8 devices: each device keeps
# `max(1, Hkv / 8)` KV head, the one its query heads read, in `W_k[D, Hkv_x]` and the KV cache
# `kv[.., P, ps, 2·Hkv_x·d]`. It keeps that head for **every request**: the batch is not split, because every
# device works on every token. Each KV head is stored `r` times over the slice: the KV factor of the baseline,
# read from the plan.
#
# <details><summary><b>Pop quiz.</b> Will `tp8_kvrep` give the same greedy tokens as one device? And its float32
# logits: equal bit for bit?</summary>
#
# The same tokens: a layout changes where the work runs, not what is computed. The logits can differ in the last
# bits, because the all-reduces after the attention output and the experts add the 8 partial sums in another
# order than one device's matmul does; greedy decoding only needs the argmax, which such rounding does not move.
# </details>
#
# **Predict.** The model computes the same function under any layout, so greedy tokens through the engine must
# equal the single-device engine's (float32: the all-reduces only change the order of summation). Run a few
# requests through both.

# %%
from qwen35_lib.plan import get_layout

kvrep_plan = get_layout("tp8_kvrep")
KV_FACTOR = kvrep_plan.kv_replication(tiny, mesh)  # copies of each KV head
print(f"tp8_kvrep: {KV_FACTOR} copies of each of {tiny.num_kv_heads} KV heads; "
      f"{kvrep_plan.kv_heads_per_device(tiny, mesh)} KV head(s) per device")
assert KV_FACTOR == 8 // tiny.num_kv_heads and kvrep_plan.kv_heads_per_device(tiny, mesh) == 1

# %%
import jax
import numpy as np

from qwen35_lib.engine import Engine, EngineConfig
from qwen35_lib.engine.sampling import SamplingParams

weights = qwen35_lib.init_weights(tiny, 0)
prompts = [list(np.random.default_rng(i).integers(2, tiny.vocab_size, size=n)) for i, n in enumerate((5, 11, 17))]
params = SamplingParams(max_new_tokens=4, ignore_eos=True)
ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)  # one prefill step, then decodes
with jax.default_matmul_precision("highest"):  # float32 matmuls in full precision on a TPU too
    single = [r.output_ids for r in Engine(tiny, weights, ec).generate(prompts, params)]
    kvrep = Engine(tiny, weights, ec, mesh=mesh, plan=get_layout("tp8_kvrep"))
    replicated = [r.output_ids for r in kvrep.generate(prompts, params)]
print("single device:", single)
print("tp8_kvrep:    ", replicated)

# %% [markdown]
# **Check.** Same tokens.

# %%
assert replicated == single

# %% [markdown]
# ### What each device holds
#
# `jax.debug.visualize_array_sharding` draws a 2-D array's shards. The embedding `embed[V, D]` is split over the
# vocabulary under `tp8_kvrep` (`embed[V_x, D]`); the KV projection of the attention layer carries the duplicated
# heads, one per device.

# %%
jax.debug.visualize_array_sharding(kvrep.weights["embed"])
w_k = kvrep.weights["layers"]["attn"]["w_k"]  # [G, Na, D, Hkv, d]
print(f"attn w_k {w_k.shape}: {w_k.sharding.spec} ({tiny.num_kv_heads} KV heads x {KV_FACTOR} copies, split 8 ways)")

# %% [markdown]
# ### The KV cache, measured from the shards
#
# <details><summary><b>Pop quiz.</b> Both layouts can hold the same 8 sequences. How many times the KV bytes does
# a `tp8_kvrep` device hold compared with a `dp8_ep8` device?</summary>
#
# About the KV factor printed above: a `tp8_kvrep` device keeps one head of all 8 sequences, a `dp8_ep8` device
# both heads of one sequence, so the ratio is `S / Hkv`, a little less because each rank also keeps a null page.
# </details>
#
# **Predict.** Hold the total capacity fixed: `S = 8` sequences of up to `max_model_len` tokens each, in pages of
# `ps` tokens (`n = max_model_len / ps` pages a sequence), plus one null page per rank that padding writes to.
# `tp8_kvrep` has one rank that holds all `S` sequences, and every device keeps its one KV head of each:
# `S · n + 1` pages of one head per device. `dp8_ep8` gives each of its 8 ranks one sequence, each rank on its own
# device, with both KV heads: `n + 1` pages of `Hkv` heads. A page of `h` heads holds `G · Na · ps · 2·h · d` values;
# the ratio tends to `S / Hkv`, the KV factor, as the null page becomes negligible.

# %%
from qwen35_lib.report import human_bytes

ps, max_len = 16, ec.max_model_len
pages_per_seq = max_len // ps
head_page_bytes = tiny.num_groups * tiny.attn_per_group * ps * 2 * tiny.head_dim * 4  # one KV head, float32
heads = {name: get_layout(name).kv_heads_per_device(tiny, mesh) for name in ("tp8_kvrep", "dp8_ep8")}
predicted = {"tp8_kvrep": (8 * pages_per_seq + 1) * head_page_bytes * heads["tp8_kvrep"],
             "dp8_ep8": (1 * pages_per_seq + 1) * head_page_bytes * heads["dp8_ep8"]}
print({k: human_bytes(v) for k, v in predicted.items()}, f"ratio {predicted['tp8_kvrep'] / predicted['dp8_ep8']:.3f}")

# %% [markdown]
# **Measure.** Build the `dp8_ep8` engine with one sequence per rank (8 ranks: the same capacity) and add up the
# bytes of the KV-cache shards that live on each device.

# %%
from qwen35_lib.placement import shard_bytes_per_device

dp = Engine(tiny, weights, EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256), mesh=mesh,
            plan=get_layout("dp8_ep8"))

measured = {name: shard_bytes_per_device(e.cache["kv"], mesh) for name, e in (("tp8_kvrep", kvrep), ("dp8_ep8", dp))}
for name, per_device in measured.items():
    print(f"{name:<10} KV cache per device: {[human_bytes(b) for b in per_device]}")

# %% [markdown]
# **Check.** Every device holds exactly the predicted bytes; the ratio is below the KV factor by the null pages
# only.

# %%
for name, per_device in measured.items():
    assert per_device == [predicted[name]] * 8, (name, per_device, predicted[name])
ratio_cpu = measured["tp8_kvrep"][0] / measured["dp8_ep8"][0]
assert ratio_cpu == (8 * pages_per_seq + 1) / (pages_per_seq + 1) / tiny.num_kv_heads
assert ratio_cpu < KV_FACTOR and (8 * pages_per_seq) / pages_per_seq / tiny.num_kv_heads == KV_FACTOR
print(f"tp8_kvrep holds {ratio_cpu:.2f}x the KV cache of dp8_ep8 per device (KV factor {KV_FACTOR})")

# %% [markdown]
# ## 3. At TPU size: Qwen3.5-397B, FP8 experts, 512 requests of 9,216 tokens
#
# A request's whole context is 9,216 tokens in either workload (8k in and 1k out, or 1k in and 8k out): the pool
# each layout must hold for 512 of them.
#
# <details><summary><b>Pop quiz.</b> 512 requests of 9,216 tokens on a TPU7x-8: which of the three layouts fits with
# a bf16 KV cache, and which with the FP8 one?</summary>
#
# With bf16, the EP layouts fit and `tp8_kvrep` does not: its KV factor multiplies a cache that is already the
# largest thing on a device after the weights. Halving the bytes per value with FP8 brings the baseline under the
# device's HBM too. The cell below prints each layout's bytes per device and verdict.
# </details>
#
# **Predict.** `qwen35_lib.placement` works out, by arithmetic over the same weight and cache
# declarations and the same layout rules, what each device holds. `tp8_kvrep` puts `r / 8` of the whole KV cache
# on every device (one head of every request), the EP layouts `1 / 8` (both heads of their own requests): with a
# bf16 KV cache, and with the FP8 cache the serving configuration uses.

# %%
FP8_KV = "float8_e4m3fn"  # the serving KV cache: one byte per value + a float32 scale per token and head

LAYOUTS = ("tp8_kvrep", "dp4_tp2_ep8", "dp8_ep8")
CONTEXT = 8192 + 1024  # a request's whole context in either workload: input plus output
bf16_plans = {name: placement(big, name, requests=512, context_len=CONTEXT) for name in LAYOUTS}
plans = {name: placement(big, name, requests=512, context_len=CONTEXT, kv_dtype=FP8_KV) for name in LAYOUTS}
for kv, ps_ in (("bf16 KV", bf16_plans), ("FP8 KV", plans)):
    print(kv)
    for name, p in ps_.items():
        print(f"  {name:<12} weights {human_bytes(p.weight_bytes_per_device):>10} + "
              f"KV {human_bytes(p.kv_bytes_per_device):>10} + "
              f"GDN state {human_bytes(p.gdn_state_bytes_per_device):>9} = "
              f"{human_bytes(p.total_bytes_per_device):>10} per device of {human_bytes(p.hbm_bytes_per_device)}: "
              f"{'fits' if p.fits else 'does NOT fit'}")
kv_factor_tpu = plans["tp8_kvrep"].copies["kv"]
print(f"KV factor at the 397B size: {kv_factor_tpu:g} copies of each KV head "
      f"({get_layout('tp8_kvrep').kv_heads_per_device(big, mesh)} head per device)")

# %% [markdown]
# **Check.** The 397B model's KV factor is the same as the tiny one's, read from the same plan. With a bf16 KV cache
# the baseline does not fit 512 requests of 9,216 tokens; with the FP8 cache it does: the baseline is a layout that
# runs, and what it loses is elsewhere (section 4).

# %%
assert kv_factor_tpu == get_layout("tp8_kvrep").kv_replication(big, mesh) == KV_FACTOR
assert not bf16_plans["tp8_kvrep"].fits and plans["tp8_kvrep"].fits and plans["dp8_ep8"].fits
assert bf16_plans["dp8_ep8"].fits and bf16_plans["dp4_tp2_ep8"].fits  # the quiz's answer: EP fits either way
kv_ratio_tpu = plans["tp8_kvrep"].kv_bytes_per_device / plans["dp8_ep8"].kv_bytes_per_device
assert abs(kv_ratio_tpu - KV_FACTOR) < 1e-3 * KV_FACTOR, kv_ratio_tpu

# %% [markdown]
# **Measure, as a TPU7x-8 would.** With libtpu installed, XLA compiles for the `tpu7x:2x2x1` topology on this
# machine (`aot.chip_core_mesh()`: its 8 TensorCores as `('chip', 'core')`). We compile a program that takes the
# full 60-layer model's weights (abstract: nothing is allocated) and the FP8 caches for 512 requests, placed by
# each layout, and read `memory_analysis()`: the bytes per device XLA assigned, or its refusal.

# %%
import importlib.util

from qwen35_lib import aot

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None  # the 'tpu' extra
xla = ({name: aot.resident_bytes(big, get_layout(name), p.cache_shape, aot.chip_core_mesh())
       for name, p in plans.items()} if HAVE_LIBTPU else {})
for name, (nbytes, error) in xla.items():
    print(f"{name:<12} XLA (tpu7x): {human_bytes(nbytes) + ' per device' if error is None else error}")
if not HAVE_LIBTPU:
    print("libtpu not installed (pip install 'jax[tpu]'): skipped the ahead-of-time compiles")

# %% [markdown]
# **Check.** Where XLA accepts the program, its per-device bytes agree with the arithmetic to within a thousandth
# (XLA pads small arrays to its tile layout); where it refuses, the prediction said it would not fit.

# %%
XLA_TOLERANCE = 1e-3  # relative: XLA's tile padding of small arrays
for name, (nbytes, error) in xla.items():
    p = plans[name]
    if error is None:
        assert abs(nbytes - p.total_bytes_per_device) <= XLA_TOLERANCE * p.total_bytes_per_device, (name, nbytes)
        assert p.fits
    else:
        assert "RESOURCE_EXHAUSTED" in error and not p.fits, (name, error)
print(f"KV cache per device, tp8_kvrep / dp8_ep8 at TPU size: {kv_ratio_tpu:.2f}x")

# %%
import matplotlib.pyplot as plt

# figure: memory
fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")  # FP8 KV
parts = (("weights", "weight_bytes_per_device", "#4C72B0"), ("KV cache", "kv_bytes_per_device", "#C44E52"),
         ("GDN state", "gdn_state_bytes_per_device", "#55A868"))
for i, (name, p) in enumerate(plans.items()):
    base = 0.0
    for label, attr, color in parts:
        ax.barh(i, getattr(p, attr) / 2**30, left=base, color=color, label=label if i == 0 else None)
        base += getattr(p, attr) / 2**30
    nbytes, error = xla.get(name, (None, None))
    note = "XLA: refused" if error else (f"XLA: {nbytes / 2**30:.1f} GiB" if nbytes else "")
    ax.text(base + 2, i, f"{base:.1f} GiB  {note}", va="center", fontsize=8)
ax.axvline(plans["dp8_ep8"].hbm_bytes_per_device / 2**30, color="black", lw=1.5)
ax.set_yticks(range(len(plans)), list(plans))
ax.set_xlabel("GiB per device (TPU7x-8: 96 GiB HBM per TensorCore; prediction, checked by an XLA compile)")
ax.set_xlim(0, 250)
ax.legend(loc="lower right", fontsize=8)
ax.set_title(f"Qwen3.5-397B-A17B (FP8 experts, FP8 KV cache), 512 requests x {CONTEXT:,} tokens", fontsize=10)
plt.show()

# %% [markdown]
# **The whole step, compiled.** The program above holds weights and caches only. The engine's step (attention,
# GDN, MoE, sampling) also needs activations. `aot.compile_step` compiles it for TPU7x, but at the real width
# that takes minutes on a CPU, too slow for this notebook; set `QWEN35_AOT_STEP=1` to run it on a 2-group (8-layer)
# variant. Per-device bytes of weights and caches grow linearly with the number of layer groups, which
# `placement` confirms below: the KV cache and GDN state of 15 groups are 15/2 of 2 groups', and each extra group
# adds the same weight bytes.

# %%
import os

from qwen35_lib.costmodel import temporaries

p4, p8, p60 = (placement(big.replace(num_layers=n), "dp8_ep8", requests=512, context_len=CONTEXT) for n in (4, 8, 60))
per_group = p8.weight_bytes_per_device - p4.weight_bytes_per_device
assert p60.weight_bytes_per_device == p8.weight_bytes_per_device + 13 * per_group
assert p60.kv_bytes_per_device * 2 == p8.kv_bytes_per_device * 15
assert p60.gdn_state_bytes_per_device * 2 == p8.gdn_state_bytes_per_device * 15
print(f"dp8_ep8, per device: one layer group of weights {human_bytes(per_group)}; 2 groups: "
      f"{human_bytes(p8.total_bytes_per_device)} of weights + caches, 15 groups: "
      f"{human_bytes(p60.total_bytes_per_device)}")
step = {}
if HAVE_LIBTPU and os.environ.get("QWEN35_AOT_STEP"):
    for name in ("tp8_kvrep", "dp8_ep8"):
        c8 = big.replace(num_layers=8)
        xla_kernels = get_layout(name).replace(kernels="xla")  # on TPU: XLA attention and GDN, ragged_dot MoE
        ma = aot.compile_step(c8, xla_kernels, aot.chip_core_mesh(), requests=512, context_len=CONTEXT,
                              decode=8).memory_analysis()
        step[name] = dict(argument_bytes=ma.argument_size_in_bytes, temp_bytes=ma.temp_size_in_bytes)
        expected = placement(c8, name, requests=512, context_len=CONTEXT).total_bytes_per_device
        print(f"{name:<10} 8-layer step: arguments {human_bytes(ma.argument_size_in_bytes)} (placement: weights + "
              f"caches {human_bytes(expected)}), temporaries {human_bytes(ma.temp_size_in_bytes)}")
        assert abs(ma.argument_size_in_bytes - expected) <= 2e-3 * expected  # + the step's small int inputs

# %% [markdown]
# **The whole step at the serving shape, from the stored sweep.** `make sweep` compiled each stage's engine step
# for `tpu7x:2x2x1` at the full depth of the 397B model: 512 requests, a pool for every request's whole context
# (the `shape` printed below) in FP8, FP8 experts, a decode step and a mixed one. It takes minutes a step, so the
# notebook reads the stored result (`data/aot/tpu7x-8.json`, with its versions and flags) and puts the baseline
# beside `dp_ep`, the next chapter's stage, which runs the same XLA kernels.

# %%
from qwen35_lib import data as data_files

stored = data_files.read_json("aot/tpu7x-8.json")
print(f"{stored['model']}, {stored['groups']} layer groups, {stored['topology']}, libtpu {stored['libtpu']}; shape:",
      stored["shape"])
swept = {}
for stage in ("baseline", "dp_ep"):
    for step in ("8k/1k decode", "8k/1k mixed"):
        e = stored["stages"][stage]["steps"][step]
        resident = e["weight_bytes"] + e["kv_bytes"] + e["gdn_state_bytes"]  # the step's arguments
        # a refusal's "HLO temporaries (N G)" is the whole footprint, arguments included (costmodel.temporaries)
        total = e["total_bytes"] if e["fits"] else temporaries.refused_bytes(e["error"])
        temp = e["temp_bytes"] if e["fits"] else temporaries.refused_temporaries(e["error"], resident)
        swept[stage, step] = dict(fits=e["fits"], resident_bytes=resident, kv_bytes=e["kv_bytes"], temp_bytes=temp,
                                  total_bytes=total, headroom_bytes=e.get("headroom_bytes"),
                                  short_bytes=None if e["fits"] else total - stored["usable_bytes"])
        verdict = (f"fits, {human_bytes(e['headroom_bytes'])} to spare" if e["fits"] else
                   f"REFUSED: needs {human_bytes(total)} of {human_bytes(stored['usable_bytes'])}")
        print(f"{stage:<9} {step:<13} weights + caches {human_bytes(resident):>10} (KV {human_bytes(e['kv_bytes'])}), "
              f"temporaries {human_bytes(temp):>10}: {verdict}")
    if not stored["stages"][stage]["steps"]["8k/1k decode"]["fits"]:
        print(f"{'':<9} the refusal: {stored['stages'][stage]['steps']['8k/1k decode']['error']}")
pools = {st: stored["stages"][st]["largest_pool"] for st in ("baseline", "dp_ep")}  # the sweep's search
for st, lp in pools.items():
    print(f"{st:<9} largest pool whose decode step compiles at 512 requests: {lp['tokens_per_seq']:,} tokens a "
          f"sequence (every request's whole context needs {stored['shape']['context_len']:,})")

# %% [markdown]
# **Reading the refusal.** The compiler's message names "HLO temporaries", but its figure is the program's whole
# footprint, arguments included: notebook 00's program of weights alone, which has no temporaries to speak of, was
# refused with a figure equal to its weights (`tests/costmodel/test_temporaries.py` asserts that they agree). So the
# baseline's temporaries are the refusal's figure minus its weights and caches (`temporaries.refused_temporaries`).
#
# **Check.** Weights and caches fit under both layouts (the arithmetic above), but the baseline's whole step does not.
# Its temporaries are not the cause: at decode they are fewer than `dp_ep`'s, and in the mixed step what they exceed
# `dp_ep`'s by is a small part of what the step lacks. What it lacks is less than the KV cache it holds beyond
# `dp_ep`'s: its one rank keeps a replicated KV head of every request on every device. The sweep's search for the
# largest pool that still compiles finds the baseline's below a request's whole context, `dp_ep`'s above it. `dp_ep`
# holds more weights a device and still compiles, with headroom. A fit is judged on the step, not on the arrays it
# reads.

# %%
usable = stored["usable_bytes"]
for step in ("8k/1k decode", "8k/1k mixed"):
    base, ep = swept["baseline", step], swept["dp_ep", step]
    assert not base["fits"] and base["resident_bytes"] < usable < base["total_bytes"], base
    # not the temporaries: at decode fewer than dp_ep's; in the mixed step what they exceed dp_ep's by is a fraction of
    # what the step lacks (with dp_ep's temporaries it would still be refused)
    assert ep["fits"] and base["temp_bytes"] - ep["temp_bytes"] < 0.25 * base["short_bytes"], (ep, base)
    assert 0 < base["short_bytes"] < base["kv_bytes"] - ep["kv_bytes"], (base, ep)  # the replicated KV cache
    assert stored["stages"]["dp_ep"]["steps"][step]["weight_bytes"] > \
        stored["stages"]["baseline"]["steps"][step]["weight_bytes"]  # every dense weight on every device
assert pools["baseline"]["tokens_per_seq"] < stored["shape"]["context_len"] <= pools["dp_ep"]["tokens_per_seq"]
base, ep = swept["baseline", "8k/1k decode"], swept["dp_ep", "8k/1k decode"]
notebook.claim_greater("refusal_not_temporaries", "the baseline's temporaries are not the cause: "
                       "{base_gib:.2f} GiB a device, fewer than `dp_ep`'s {ep_gib:.2f} GiB", 1.0,
                       ep_gib=ep["temp_bytes"] / 2**30, base_gib=base["temp_bytes"] / 2**30)
notebook.claim_greater("refusal_is_the_kv_copy", "what the baseline's decode step is short by, {short_gib:.2f} GiB, is "
                       "less than the KV cache it holds beyond `dp_ep`'s, {extra_gib:.2f} GiB a device (its replicated "
                       "KV heads)", 1.0, extra_gib=(base["kv_bytes"] - ep["kv_bytes"]) / 2**30,
                       short_gib=base["short_bytes"] / 2**30)
w_swept = stored["stages"]["baseline"]["steps"]["8k/1k decode"]["weight_bytes"]  # placement's arithmetic, too
assert abs(w_swept - plans["tp8_kvrep"].weight_bytes_per_device) <= 1e-3 * w_swept, w_swept

# %% [markdown]
# ## 4. What the KV factor costs, with the FP8 cache: capacity and bandwidth
#
# <details><summary><b>Pop quiz.</b> In one decode step over 512 requests, how much more KV cache does a
# `tp8_kvrep` device read than a `dp8_ep8` device?</summary>
#
# The KV factor `r` times as much: the decode step reads every running request's cache once, and a baseline
# device holds one head of every request, which is `r` times what an EP device holds of its own requests.
# </details>
#
# **Compute.** The baseline fits, so its price is not a refusal. *Capacity*: each device's KV pool holds one head of
# every request, so the HBM left after the weights holds `1 / r` of the requests the same bytes would hold split
# by request. *Bandwidth*: a decode step reads the KV cache of every running request once; under `tp8_kvrep` each
# device reads one head of all of them, `r` times the bytes a `dp8_ep8` device reads for its own requests' heads,
# at the same HBM bandwidth (`costmodel.specs`, from `data/hardware.json`).

# %%
from qwen35_lib.costmodel import specs as hw_specs

tpu = hw_specs.get("tpu7x-8")
per_request = {name: (p.kv_bytes_per_device + p.gdn_state_bytes_per_device) / p.requests * p.ranks
               for name, p in plans.items()}  # cache bytes of one request on each device holding it
slice_requests = {name: int((p.usable_hbm_bytes_per_device - p.weight_bytes_per_device) // per_request[name])
                  * p.ranks for name, p in plans.items()}
kv_read_ms = {name: 1e3 * p.kv_bytes_per_device / tpu.hbm_bytes_per_s for name, p in plans.items()}
for name in LAYOUTS:
    print(f"{name:<12} requests of {CONTEXT:,} tokens the slice holds: {slice_requests[name]:>5}; one decode step "
          f"over 512 of them reads {human_bytes(plans[name].kv_bytes_per_device)} of KV per device: "
          f"{kv_read_ms[name]:.2f} ms at {tpu.hbm_bytes_per_s / 1e12:.1f} TB/s")

# %% [markdown]
# **Check.** The baseline holds fewer requests than the EP layouts and reads `r` times their KV bytes per decode
# step: the reads the cost model of section 0 charges to attention.

# %%
assert slice_requests["tp8_kvrep"] < slice_requests["dp8_ep8"]
assert abs(kv_read_ms["tp8_kvrep"] / kv_read_ms["dp8_ep8"] - KV_FACTOR) < 1e-3 * KV_FACTOR

# %% [markdown]
# ## 5. Explore
#
# The sharding explorer shows what each device holds under any preset, layout and device count, and the rule that
# breaks. Try `tp8` (the KV-head row turns red), then `tp8_kvrep` with the KV dtype at bf16 and at FP8: which fits
# 512 requests? (The widget needs a live kernel; the figure below it is the same view, static.)

# %%
from qwen35_lib.viz.sharding_explorer import sharding_explorer

sharding_explorer(layout="tp8")

# %%
from qwen35_lib.viz.sharding_explorer import placement_figure

placement_figure(plans["tp8_kvrep"])

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(
    tp8_refusal=refusal, tokens_equal=replicated == single,
    cpu_kv_bytes_per_device={k: v[0] for k, v in measured.items()}, cpu_kv_ratio=ratio_cpu,
    kv_factor=KV_FACTOR, tpu_kv_ratio=kv_ratio_tpu, kv_dtype=FP8_KV,
    tpu={name: dict(weight_bytes=p.weight_bytes_per_device, kv_bytes=p.kv_bytes_per_device,
                    gdn_state_bytes=p.gdn_state_bytes_per_device, total_bytes=p.total_bytes_per_device,
                    fits=p.fits, xla_argument_bytes=xla.get(name, (None, None))[0],
                    xla_error=xla.get(name, (None, None))[1], slice_requests=slice_requests[name],
                    kv_read_ms=kv_read_ms[name]) for name, p in plans.items()},
    tpu_bf16_kv={name: dict(kv_bytes=p.kv_bytes_per_device, total_bytes=p.total_bytes_per_device, fits=p.fits)
                 for name, p in bf16_plans.items()},
    hbm_bytes_per_device=plans["tp8_kvrep"].hbm_bytes_per_device,
    stages=stages, step_8_layers=step,
    sweep={f"{stage}_{step.split()[1]}": v for (stage, step), v in swept.items()},  # the stored TPU7x compiles
    largest_pool_tokens={st: lp["tokens_per_seq"] for st, lp in pools.items()},
    whole_context_tokens=stored["shape"]["context_len"], usable_bytes=stored["usable_bytes"])
notebook.save_results("naive_tp", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> With 2 KV heads, 8-way tensor parallelism runs only by storing each KV head on the 4 devices
# whose query heads read it: with an FP8 cache the baseline fits, but every device keeps and reads a head of every
# request, the KV factor times what splitting requests costs, so attention should be split by request (data
# parallelism), not by head.
# </div>
#
# ## What we learned
#
# - A layout must give each device whole heads; 2 KV heads over 8 devices do not split, and binding the plan
#   (`plan.bind(mesh, config)`) says so before anything is placed.
# - Duplicating KV heads in the weights makes tensor parallelism run, at the price of the KV factor: every device
#   keeps and reads a copy of its head for every request.
# - The price shows as capacity (fewer requests fit) and as bandwidth (more bytes read per decode step), both
#   computed from the same plan the engine runs, and checked against real shards and the TPU7x compile.
# - The notation `W[E, D, F_x]` says where a dim is split; `weight_notation` writes it from the placement itself.

# %% [markdown]
# ## Exercises
#
# 1. **[bf16 KV cache]** Section 3 printed the bf16 cache beside the FP8 one. How many requests of 9,216 tokens does
#    `tp8_kvrep` fit with a bf16 KV cache?
#    <details><summary>Answer</summary>
#
#    Lower `requests` in `placement(big, "tp8_kvrep", requests=..., context_len=CONTEXT).fits` until it is True (a
#    bisection over `requests` finds the largest): the bf16 cache is twice the FP8 one's bytes per token, so the
#    baseline with a bf16 cache holds well under 512, while `dp8_ep8` still fits them all.
#    </details>
#
# 2. **[Four KV heads]** A model with 4 KV heads on the same 8 devices: what would binding `tp8` say (`plan.bind`),
#    and what is the smallest KV replication that works?
#    <details><summary>Answer</summary>
#
#    `get_layout("tp8").bind(mesh, tiny.replace(num_kv_heads=4, num_q_heads=8))` still refuses (4/8 = 0.5).
#    Splitting KV heads over `core` and requests over `chip` (`dp4_tp2_ep8`) works for 2 or 4 KV heads; with 8
#    KV heads plain `tp8` would.
#    </details>
#
# 3. **[Where the copies go]** `placement(big, "tp8_kvrep").copies` reports how many copies of the weights, KV
#    cache and GDN state the 8 devices hold together. Explain each number.
#    <details><summary>Answer</summary>
#
#    Weights about one copy (everything is split 8 ways except the norms and the router; the KV projections carry
#    the duplicated heads); KV cache `r = 8 / Hkv` copies (each head on the 4 devices whose query heads read it);
#    GDN state one copy (GDN heads split 8 ways, every device holds an eighth of every request's state).
#    </details>
#
# 4. **[Null page]** In section 2 the CPU ratio was below the KV factor. What context length makes it 3.99?
#    <details><summary>Answer</summary>
#
#    The ratio is `(8n + 1) / (2 (n + 1))` for `n` pages per sequence (8 sequences on one head against one
#    sequence on both heads): `n = 349` pages, `349 * 16` tokens, gives 3.99.
#    </details>

# %% [markdown]
# **The answers, computed.** Each exercise's numbers, from this run, folded until you open them.

# %%
lo, hi = 0, 512  # the largest request count whose bf16-cache placement fits: a bisection
while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if placement(big, "tp8_kvrep", requests=mid, context_len=CONTEXT).fits else (lo, mid - 1)
notebook.answer(1, "{n} requests of {ctx:,} tokens with a bf16 KV cache under tp8_kvrep (dp8_ep8 fits all 512: "
                "{dp}).", n=lo, ctx=CONTEXT, dp=bf16_plans["dp8_ep8"].fits)
four = tiny.replace(num_kv_heads=4, num_q_heads=8)
try:
    get_layout("tp8").bind(mesh, four)
    said = "nothing: it binds"
except ValueError as e:
    said = str(e).split(";")[0]
notebook.answer(2, "tp8 refuses: \"{said}\"; tp8_kvrep replicates each of the 4 KV heads {r} times (8 / 4), the "
                "smallest replication that works.", said=said, r=get_layout("tp8_kvrep").kv_replication(four, mesh))
c = placement(big, "tp8_kvrep").copies
notebook.answer(3, "weights {w:.2f} copies, KV cache {kv:.2f}, GDN state {g:.2f}.", w=c["weights"], kv=c["kv"],
                g=c["gdn_state"])
n_pages = next(n for n in range(1, 10_000) if (8 * n + 1) / (2 * (n + 1)) >= 3.99)
notebook.answer(4, "{n} pages a sequence ({tokens:,} tokens at {ps} a page): (8 x {n} + 1) / (2 x ({n} + 1)) = "
                "{ratio:.4f}.", n=n_pages, ps=ps, tokens=ps * n_pages, ratio=(8 * n_pages + 1) / (2 * (n_pages + 1)))
