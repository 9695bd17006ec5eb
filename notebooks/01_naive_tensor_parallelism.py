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
# # 01 · Naive tensor parallelism: why 8-way TP breaks on 2 KV heads
#
# The textbook way to put one model on 8 devices is tensor parallelism: split every weight matrix along its
# heads (or its FFN columns) 8 ways, and all-reduce the partial sums. Qwen3.5-397B-A17B has 32 query heads, which
# split fine, but only **2 KV heads**: 2/8 = 0.25 of a head per device. This notebook asks what that breaks, what
# the usual patch (replicate the KV heads on every device) costs in KV-cache memory, and whether the patched
# layout still fits 512 concurrent requests on a TPU7x-8.

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/01_naive_tensor_parallelism.ipynb)

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

import jax
import matplotlib.pyplot as plt
import numpy as np

import qwen35_lib
from qwen35_lib import aot
from qwen35_lib.engine.engine import Engine, EngineConfig
from qwen35_lib.engine.sampling import SamplingParams
from qwen35_lib.parallel import check_layout, make_mesh
from qwen35_lib.placement import placement, shard_bytes_per_device
from qwen35_lib.report import human_bytes
from qwen35_lib.viz.sharding_explorer import placement_figure, sharding_explorer

mesh = make_mesh()  # the 8 devices as ('chip': 4, 'core': 2)
big = qwen35_lib.get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn", gdn_state_dtype="bfloat16")
tiny = qwen35_lib.get_config("qwen3.5-tiny", dtype="float32")  # numeric checks: float32, seconds on a CPU
print(mesh)

# %% [markdown]
# ## 1. Heads per device
#
# **Predict.** Tensor parallelism over all 8 devices (`('chip', 'core')`, written `x` below) gives every device
# `1/8` of each head axis: attention weights `W_q[D, Hq_x]`, `W_k[D, Hkv_x]`, the expert FFN `W[E, D, F_x]`. A
# device can only compute attention for *whole* KV heads: K and V of a head are one vector per token, and a query
# head attends against exactly one of them. So the split must give an integer.

# %%
for c in (big, tiny):
    print(f"{c.name:<18} query heads {c.num_q_heads:>2}/8 = {c.num_q_heads / 8:<5g} KV heads {c.num_kv_heads}/8 = "
          f"{c.num_kv_heads / 8:<5g} GDN value heads {c.gdn_num_v_heads}/8 = {c.gdn_num_v_heads / 8:<5g} "
          f"experts {c.num_experts}/8 = {c.num_experts / 8:g}")

# %% [markdown]
# **Measure.** `check_layout` is what every entry point (the engine, `shard_weights`, the ahead-of-time compile)
# calls before placing anything. Ask it for `tp8`.

# %%
try:
    check_layout(tiny.replace(layout="tp8"), mesh)
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
# ## 2. The patch: replicate the KV heads (`tp8_kvrep`)
#
# `tp8_kvrep` splits everything `tp8` splits except the KV heads: `W_k[D, Hkv]` and `W_v[D, Hkv]` are whole on
# every device, and so is the KV cache `kv[.., P, ps, 2·Hkv·d]`. Every device computes K and V for both heads
# (a little redundant matmul work) and keeps them for **every request**: the batch is not split either, because
# every device works on every token.
#
# **Predict.** The model computes the same function under any layout, so greedy tokens through the engine must
# equal the single-device engine's (float32: the all-reduces only change the order of summation). Run three
# requests through both.

# %%
weights = qwen35_lib.init_weights(tiny, 0)
prompts = [list(np.random.default_rng(i).integers(2, tiny.vocab_size, size=n)) for i, n in enumerate((5, 11, 17))]
params = SamplingParams(max_new_tokens=4, ignore_eos=True)
ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)  # one prefill step, then decodes
with jax.default_matmul_precision("highest"):  # float32 matmuls in full precision on a TPU too
    single = [r.output_ids for r in Engine(tiny, weights, ec).generate(prompts, params)]
    kvrep = Engine(tiny.replace(layout="tp8_kvrep"), weights, ec, mesh=mesh)
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
# vocabulary under `tp8_kvrep` (`embed[V_x, D]`); the KV projection of the attention layer is not split at all.

# %%
jax.debug.visualize_array_sharding(kvrep.weights["embed"])
w_k = kvrep.weights["layers"]["attn"]["w_k"]  # [G, Na, D, Hkv, d]
print(f"attn w_k {w_k.shape}: {w_k.sharding.spec} (all {tiny.num_kv_heads} KV heads on every device)")

# %% [markdown]
# ### The KV cache, measured from the shards
#
# **Predict.** Hold the total capacity fixed: 8 sequences of up to 256 tokens (pages of 16 tokens, plus one null
# page per rank that padding writes to). `tp8_kvrep` has one rank that holds all 8 sequences, and every device
# keeps a full copy: `8 · 16 + 1 = 129` pages per device. `dp8_ep8` gives each of its 8 ranks one sequence, each
# rank on its own device: `16 + 1 = 17` pages per device. A page holds `G · Na · 16 · 2·Hkv · d` values.

# %%
page_bytes = tiny.num_groups * tiny.attn_per_group * 16 * 2 * tiny.num_kv_heads * tiny.head_dim * 4  # float32
pages_per_seq = 256 // 16
predicted = {"tp8_kvrep": (8 * pages_per_seq + 1) * page_bytes, "dp8_ep8": (1 * pages_per_seq + 1) * page_bytes}
print({k: human_bytes(v) for k, v in predicted.items()}, f"ratio {predicted['tp8_kvrep'] / predicted['dp8_ep8']:.3f}")

# %% [markdown]
# **Measure.** Build the `dp8_ep8` engine with one sequence per rank (8 ranks: the same capacity) and add up the
# bytes of the KV-cache shards that live on each device.

# %%
dp = Engine(tiny.replace(layout="dp8_ep8"), weights,
            EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256), mesh=mesh)

measured = {name: shard_bytes_per_device(e.cache["kv"], mesh) for name, e in (("tp8_kvrep", kvrep), ("dp8_ep8", dp))}
for name, per_device in measured.items():
    print(f"{name:<10} KV cache per device: {[human_bytes(b) for b in per_device]}")

# %% [markdown]
# **Check.** Every device holds exactly the predicted bytes; the ratio tends to 8 as the null page becomes
# negligible (at 8k-token contexts it is 8.00).

# %%
for name, per_device in measured.items():
    assert per_device == [predicted[name]] * 8, (name, per_device, predicted[name])
ratio_cpu = measured["tp8_kvrep"][0] / measured["dp8_ep8"][0]
assert ratio_cpu == (8 * pages_per_seq + 1) / (pages_per_seq + 1)
print(f"tp8_kvrep holds {ratio_cpu:.2f}x the KV cache of dp8_ep8 per device")

# %% [markdown]
# ## 3. At TPU size: Qwen3.5-397B, FP8 experts, 512 requests of 8k tokens
#
# **Predict.** `qwen35_lib.placement` works out, by arithmetic over the same weight and cache
# declarations and the same layout rules, what each device holds. The KV cache of 512 requests x 8192 tokens
# is 120 GiB in all (bf16); `tp8_kvrep` puts all of it on every device.

# %%
LAYOUTS = ("tp8_kvrep", "dp4_tp2_ep8", "dp8_ep8")
plans = {name: placement(big, name, requests=512, context_len=8192) for name in LAYOUTS}
for name, p in plans.items():
    print(f"{name:<12} weights {human_bytes(p.weight_bytes_per_device):>10} + "
          f"KV {human_bytes(p.kv_bytes_per_device):>10} + "
          f"GDN state {human_bytes(p.gdn_state_bytes_per_device):>9} = "
          f"{human_bytes(p.total_bytes_per_device):>10} per device of {human_bytes(p.hbm_bytes_per_device)}: "
          f"{'fits' if p.fits else 'does NOT fit'}")

# %% [markdown]
# **Measure, as a TPU7x-8 would.** With libtpu installed, XLA compiles for the `tpu7x:2x2x1` topology on this
# machine (`aot.chip_core_mesh()`: its 8 TensorCores as `('chip', 'core')`). We compile a program that takes the
# full 60-layer model's weights (abstract: nothing is allocated) and the caches for 512 requests, placed by each
# layout, and read `memory_analysis()`: the bytes per device XLA assigned, or its refusal.

# %%
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None  # the 'tpu' extra
xla = ({name: aot.resident_bytes(big.replace(layout=name), p.cache_shape, aot.chip_core_mesh())
       for name, p in plans.items()} if HAVE_LIBTPU else {})
for name, (nbytes, error) in xla.items():
    print(f"{name:<12} XLA (tpu7x): {human_bytes(nbytes) + ' per device' if error is None else error}")
if not HAVE_LIBTPU:
    print("libtpu not installed (pip install 'jax[tpu]'): skipped the ahead-of-time compiles")

# %% [markdown]
# **Check.** Where XLA accepts the program, its per-device bytes agree with the arithmetic to within 0.1% (XLA
# pads small arrays to its tile layout); where it refuses, the prediction said it would not fit. `tp8_kvrep`
# needs its 120 GiB of replicated KV cache on each device: no TPU7x-8 holds that, whatever else we do. The EP
# layouts hold 1/8 of it each and fit, with about 10 GiB left per device for the step's activations.

# %%
for name, (nbytes, error) in xla.items():
    p = plans[name]
    if error is None:
        assert abs(nbytes - p.total_bytes_per_device) <= 1e-3 * p.total_bytes_per_device, (name, nbytes)
        assert p.fits
    else:
        assert "RESOURCE_EXHAUSTED" in error and not p.fits, (name, error)
assert not plans["tp8_kvrep"].fits and plans["dp8_ep8"].fits
kv_ratio_tpu = plans["tp8_kvrep"].kv_bytes_per_device / plans["dp8_ep8"].kv_bytes_per_device
print(f"KV cache per device, tp8_kvrep / dp8_ep8 at TPU size: {kv_ratio_tpu:.2f}x")

# %%
fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
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
ax.set_title("Qwen3.5-397B-A17B (FP8 experts), 512 requests x 8k tokens", fontsize=10)
plt.show()

# %% [markdown]
# **The whole step, compiled.** The program above holds weights and caches only. The engine's step (attention,
# GDN, MoE, sampling) also needs activations. `aot.compile_step` compiles it for TPU7x, but at the real width
# that takes minutes on a CPU, too slow for this notebook; set `QWEN35_AOT_STEP=1` to run it on a 2-group (8-layer)
# variant. Per-device bytes of weights and caches grow linearly with the number of layer groups, which
# `placement` confirms below: the KV cache and GDN state of 15 groups are 15/2 of 2 groups', and each extra group
# adds the same weight bytes.

# %%
p4, p8, p60 = (placement(big.replace(num_layers=n), "dp8_ep8", requests=512, context_len=8192) for n in (4, 8, 60))
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
        c8 = big.replace(num_layers=8, layout=name, attention_kernel="xla", gdn_kernel="xla", moe_kernel="ragged_dot")
        ma = aot.compile_step(c8, aot.chip_core_mesh(), requests=512, context_len=8192, decode=8).memory_analysis()
        step[name] = dict(argument_bytes=ma.argument_size_in_bytes, temp_bytes=ma.temp_size_in_bytes)
        expected = placement(c8, name, requests=512, context_len=8192).total_bytes_per_device
        print(f"{name:<10} 8-layer step: arguments {human_bytes(ma.argument_size_in_bytes)} (placement: weights + "
              f"caches {human_bytes(expected)}), temporaries {human_bytes(ma.temp_size_in_bytes)}")
        assert abs(ma.argument_size_in_bytes - expected) <= 2e-3 * expected  # + the step's small int inputs

# %% [markdown]
# ## 4. Explore
#
# The sharding explorer shows what each device holds under any preset, layout and device count, and the rule that
# breaks. Try `tp8` (the KV-head row turns red), then `tp8_kvrep` with the KV dtype at FP8 and 256 requests:
# does it fit then? (The widget needs a live kernel; the figure below it is the same view, static.)

# %%
sharding_explorer(layout="tp8")

# %%
placement_figure(plans["tp8_kvrep"])

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(
    tp8_refusal=refusal, tokens_equal=replicated == single,
    cpu_kv_bytes_per_device={k: v[0] for k, v in measured.items()}, cpu_kv_ratio=ratio_cpu,
    tpu_kv_ratio=kv_ratio_tpu,
    tpu={name: dict(weight_bytes=p.weight_bytes_per_device, kv_bytes=p.kv_bytes_per_device,
                    gdn_state_bytes=p.gdn_state_bytes_per_device, total_bytes=p.total_bytes_per_device,
                    fits=p.fits, xla_argument_bytes=xla.get(name, (None, None))[0],
                    xla_error=xla.get(name, (None, None))[1]) for name, p in plans.items()},
    step_8_layers=step)
notebook.save_results("naive_tp", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> With 2 KV heads, 8-way tensor parallelism can only run by replicating the KV cache on every
# device, 8x the memory of splitting requests instead: 120 GiB per device for 512 requests of 8k tokens, more than
# a TPU7x TensorCore has, so attention must be split by request (data parallelism), not by head.
# </div>

# %% [markdown]
# ## Exercises
#
# 1. **[FP8 KV cache]** An FP8 (e4m3) KV cache halves the bytes per token. Does `tp8_kvrep` fit 512 requests of 8k
#    tokens then? How many requests does it fit?
#    <details><summary>Answer</summary>
#
#    `placement(big, "tp8_kvrep", kv_dtype="float8_e4m3fn", requests=512).fits` is False: 60 GiB of KV cache
#    (plus per-token scales) on top of the weights and GDN state. Halve `requests` until it fits (about 256 to
#    300): still far below what `dp8_ep8` holds at the same memory.
#    </details>
#
# 2. **[Four KV heads]** A model with 4 KV heads on the same 8 devices: what would `check_layout` say for `tp8`,
#    and what is the smallest KV replication that works?
#    <details><summary>Answer</summary>
#
#    `check_layout(tiny.replace(num_kv_heads=4, num_q_heads=8, layout="tp8"), mesh)` still refuses (4/8 = 0.5).
#    Splitting KV heads over `core` and requests over `chip` (`dp4_tp2_ep8`) works for 2 or 4 KV heads; with 8
#    KV heads plain `tp8` would.
#    </details>
#
# 3. **[Where the copies go]** `placement(big, "tp8_kvrep").copies` reports how many copies of the weights, KV
#    cache and GDN state the 8 devices hold together. Explain each number.
#    <details><summary>Answer</summary>
#
#    Weights about 1x (everything is split 8 ways except the small KV projections, norms and the router); KV
#    cache 8x (every device a full copy); GDN state 1x (GDN heads split 8 ways, every device holds 1/8 of every
#    request's state).
#    </details>
#
# 4. **[Null page]** In section 2 the CPU ratio was below 8. What context length makes it 7.99?
#    <details><summary>Answer</summary>
#
#    The ratio is `(8n + 1) / (n + 1)` for `n` pages per sequence: `n = 699` pages (about 11k tokens) gives 7.99.
#    </details>
