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
# # 05 · Kernel swaps: what do Pallas kernels buy over XLA's generic code on TPU7x?
#
# With the layout and the collectives settled (notebooks 02-04), a step's time is in its computation. The last
# rung of the ladder swaps five pieces of XLA's generic code for Pallas TPU kernels: **batched ragged paged
# attention**, the MoE's **grouped GEMM**, the **chunked gated delta rule**, the **gather/scatter permutes** and the
# **dense projections**.
# For each: which roofline bounds it on a TPU7x TensorCore, what the kernel changes about the bytes and FLOPs,
# whether it computes the same thing as its XLA twin (checked here: run by the TPU itself on a TPU runtime, in Pallas
# interpret mode elsewhere), whether it lowers for the real chip (compiled for `tpu7x:2x2x1` ahead of time), and what
# the cost model says it buys.

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/05_kernel_swaps.ipynb)

# %%
import importlib.util, os, subprocess, sys  # noqa: E401, I001 (one line: the setup stays short)

sys.path.append(os.path.dirname(os.getcwd()))  # from a checkout's notebooks/ folder: its library, not installed
REPO = os.environ.get("QWEN35_REPO") or "qwen35-playbook/qwen35-playbook"  # a fork: set $QWEN35_REPO
if importlib.util.find_spec("qwen35_lib") is None:  # Colab: pip-install it from GitHub (elsewhere: nothing happens)
    pip = subprocess.run(f"{sys.executable} -m pip install -q 'qwen35-playbook[reference] @ git+https://github.com/{REPO}'",
                         shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if pip.returncode:  # pip's exit status, and its last lines: why it failed
        raise RuntimeError(f"pip failed ({pip.returncode}):\n" + "\n".join(pip.stdout.splitlines()[-20:]))

# %% [markdown]
# **What runs where.** This chapter places no layout, so it keeps an accelerator even when it has fewer devices
# than the layouts need (Colab's single-chip TPUs): JAX's default backend is then the accelerator, with the 8
# simulated CPU devices beside it. `notebook.setup` chooses and prints it; `notebook.runtime()` is the record:
#
# | runtime | XLA twins | Pallas TPU kernels | the TPU7x compile (with libtpu) |
# |---|---|---|---|
# | no accelerator (a laptop, CI) | the CPU | interpret mode on the CPU: numerics only | ahead of time, on the CPU |
# | a TPU, any number of chips | the TPU | compiled by Mosaic for that TPU and run on it | ahead of time, beside it |
# | a GPU | the GPU | interpret mode on the GPU, beside their twins: numerics only | ahead of time, on the CPU |
#
# A TPU that is not a TPU7x runs the kernels for real, but its times are those of its own chip, not of TPU7x; on a
# GPU the Pallas TPU kernels cannot be compiled for the device at all. The chapters that place layouts run them on
# 8 simulated CPU devices unless the accelerator has 8 devices of its own.

# %%
from qwen35_lib import notebook  # the kernels on the accelerator, even one with fewer than 8 devices

devices, SIZE, mesh = notebook.setup(prefer_accelerator=True)

# %% [markdown]
# ## 1. Predict: the five kernels on one TensorCore's roofline
#
# <details><summary><b>Pop quiz.</b> At 512 concurrent requests, is a decode step's grouped matmul bound by the MXU
# or by HBM under XLA? And does a kernel that reads fewer bytes make it compute-bound?</summary>
#
# By HBM: each local expert sees only a handful of token copies per step (the primer's quiz), so its weights are
# used for a few FLOPs a byte, far below the ridge. Reading fewer bytes shortens the step, but the kernel stays on
# the memory side of the roofline: it wins by moving less at the same low intensity. The table below says which
# bound each case hits.
# </details>
#
# A TensorCore of TPU7x does its peak bf16 matmul FLOP/s and streams its HBM bandwidth (`data/hardware.json`; the
# cell prints both), so an op needs their ratio in FLOPs per byte it moves (the **ridge point**) before compute,
# not memory, bounds it. The cost model
# (`qwen35_lib.costmodel.ops`) counts each kernel's FLOPs and HBM bytes for one layer on one device, for the
# serving model (FP8 experts, FP8 KV cache) at 512 concurrent requests: a **decode** step (512 decodes, mean
# context over half the longest) and a **prefill** step (one chunk of the token budget per data-parallel rank),
# under the `hier_rs` stage
# (XLA kernels) and the `kernels` stage (Pallas). What each kernel changes, in the model's terms:
# - attention: XLA's paged attention walks the pages in groups of `WALK_ROWS` tokens sorted by context and scores
#   every token against its *group's longest* context; the ragged kernel reads each sequence's own pages once, and
#   the whole query group of a KV head together;
# - grouped GEMM: XLA's path copies each layer group's FP8 expert weights out of the scanned stack and
#   dequantizes them into a bf16 copy that `ragged_dot` then reads; the kernel reads the FP8 weights once, in
#   place. (It would also skip an expert that got no tokens, but at 512 requests every local expert gets some:
#   section 3 counts them.);
# - GDN: at decode XLA's twin gathers each sequence's state out of the pool, steps it and scatters it back; the
#   kernel reads and writes each state in place. At prefill both read and write a sequence's state once;
# - permutes: this library's MoE layer around the Pallas grouped GEMM moves the routed rows with an XLA gather for
#   its dispatch and the Pallas combine, weighted, in several passes over them as compiled (the fact
#   `kernels_moe_permute_passes`; production's layer makes two). What production gains on the permutes it gains
#   elsewhere too: tpu-inference runs them on the **SparseCore**, a labelled assumption of its plans
#   (`sparsecore_permute`), not of this stage.
# - dense projections (attention's and GDN's, the shared expert's, the router's; the row `dense` is one layer's,
#   averaged over the 3:1 layer pattern): XLA's dots read each layer's weights as slices of the layer scan's stack,
#   several passes over them as compiled (`xla_weight_passes`); the Pallas projection (`kernels/dense/pallas.py`)
#   streams each layer's blocks from where they lie (`pallas_dense_weight_passes`). Section 3 prices it in the step.
# Where XLA's compiled code moves more than the arithmetic says, the model charges what the TPU7x compile moves,
# read off its HLO text (`costmodel.compiled`; the facts in `data/costmodel_hardware.json`, each with its ops).

# %%
import concurrent.futures
import importlib.util

import jax

from qwen35_lib.bench import kernels as kb
from qwen35_lib.bench.timing import dict_table

RT = notebook.runtime()  # where the twins and the Pallas kernels run (RT.twins, RT.pallas), said in RT.description
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None  # the 'tpu' extra: ahead-of-time TPU7x compiles
# Start the TPU7x compiles now (Mosaic lowering of each kernel at the 397B shapes, ~15 s); read them in each section.
aot = concurrent.futures.ThreadPoolExecutor(1).submit(kb.tpu7x_compile_rows) if HAVE_LIBTPU else None
compiled = lambda kernel: kb.compile_summary(aot.result() if aot else None, kernel)  # one line per kernel
# The float32 checks compare summation orders, so on an accelerator float32 matmuls run in float32 (not as a TPU's
# bf16 passes or a GPU's TF32); the bf16 attention keeps the default (Mosaic refuses a bf16 dot at "highest").
float32 = lambda: jax.default_matmul_precision("highest" if RT.twins != "cpu" else None)

roof = kb.roofline_rows()
for r in roof:
    r.update(gflop=r["flops"] / 1e9, mib=r["hbm_bytes"] / 2**20, flop_per_byte=r["intensity"], us=r["seconds"] * 1e6)
print(dict_table(roof, ("kernel", "case", "implementation", "gflop", "mib", "flop_per_byte", "bound", "us")))
print(f"ridge point: {roof[0]['ridge']:.0f} FLOPs per byte ({roof[0]['hardware']}, one TensorCore: "
      f"{roof[0]['peak_flops'] / 1e15:.2f} PFLOP/s, {roof[0]['hbm_bytes_per_s'] / 1e12:.2f} TB/s)")

# %%
import numpy as np
from IPython.display import display
from matplotlib.figure import Figure

# figure: roofline
fig = Figure(figsize=(7, 4), layout="constrained")
ax = fig.subplots()
x = np.logspace(-1.5, 4, 200)
ax.loglog(x, np.minimum(roof[0]["peak_flops"], x * roof[0]["hbm_bytes_per_s"]) / 1e12, "k-", lw=1)
colors = dict(attention="C0", moe_matmul="C1", gdn="C2", permute="C3", dense="C4")
for r in roof:
    ai = max(r["intensity"], 0.05)  # the permutes do no FLOPs: drawn at the left edge
    ax.scatter(ai, min(r["peak_flops"], ai * r["hbm_bytes_per_s"]) / 1e12, s=50, edgecolors=colors[r["kernel"]],
               facecolors="none" if r["implementation"] == "xla" else colors[r["kernel"]],
               marker="o" if r["case"] == "decode" else "s",
               label=f"{r['kernel']} {r['case']}" if r["implementation"] == "pallas" else None)
ax.axvline(roof[0]["ridge"], ls=":", c="gray")
ax.set_xlabel("arithmetic intensity (FLOPs per HBM byte)")
ax.set_ylabel("attainable TFLOP/s (one TensorCore)")
ax.set_title("TPU7x roofline, predicted: filled = Pallas, hollow = XLA; o decode, s prefill")
ax.legend(fontsize=7, ncol=2)
display(fig)

# %% [markdown]
# Decode is memory-bound for all five kernels, with XLA or Pallas: 512 decodes of FP8 KV cache and about `k` token
# copies per local expert are far left of the ridge, so the kernels must win by moving *fewer bytes*, and they do (the
# table's `mib` column), for attention (no group's-longest padding), for the grouped GEMM (each FP8 expert weight read
# once, in place, with no copies) and for the dense projections (each weight read once, not in XLA's passes over the
# scan's slices: the same FLOPs at a higher intensity). In prefill the Pallas attention and grouped GEMM cross the ridge
# and become compute-bound: the bytes XLA wastes are what kept them memory-bound. The dense projections' prefill uses
# each weight byte many times (a chunk of the token budget per rank): compute-bound under the Pallas projection, and
# XLA's extra passes over the weights cost it little time (the `us` column: within a quarter). In decode the attention
# kernel drops the padded reads and their FLOPs (each sequence's own context, not its group's longest), and reads each
# KV byte once where this library's XLA path's compiled page loop moves several bytes per KV element (`kv_read_bytes`):
# its point moves right along the roofline, at a higher intensity, as well as doing less work. GDN's decode moves fewer
# bytes under its kernel, by the ratio of their passes over the states (XLA's gather of the decoding sequences' states
# and its scatter back, `xla_tpu_gdn_state_passes` as compiled, against the kernel's one read and one write: the `mib`
# column); its prefill the same. The permutes (no FLOPs at all: drawn at the left edge) move fewer bytes under the
# kernels, by the ratio of their passes over the routed rows: this library's layer around the Pallas grouped GEMM makes
# `kernels_moe_permute_passes` of them as compiled, where the model prices XLA's path at four (in prefill the Pallas
# combine also writes, reads and casts its float32 sums, in HBM once they outgrow the scoped VMEM: a little more). A
# saving, but a small one beside the others.

# %%
from qwen35_lib import data as data_files

mib = {(r["kernel"], r["case"], r["implementation"]): r["mib"] for r in roof}
gdn_passes = data_files.read_json("costmodel_hardware.json")["kernels"]["xla_tpu_gdn_state_passes"]["value"]
assert abs(mib["gdn", "decode", "xla"] / mib["gdn", "decode", "pallas"] - gdn_passes / 2) < 1e-6, mib
assert mib["gdn", "prefill", "xla"] == mib["gdn", "prefill", "pallas"], mib

permute_passes = data_files.read_json("costmodel_hardware.json")["kernels"]["kernels_moe_permute_passes"]["value"]
# the ratio of their passes over the routed rows (the kernels' compiled, XLA's 4); in prefill the combine's float32 sums
assert abs(mib["permute", "decode", "pallas"] / mib["permute", "decode", "xla"] - permute_passes / 4) < 1e-6, mib
assert permute_passes / 4 - 1e-6 <= mib["permute", "prefill", "pallas"] / mib["permute", "prefill", "xla"] < 1, mib
bound = {(r["kernel"], r["case"], r["implementation"]): r["bound"] for r in roof}
assert all(b == "memory" for (_, case, _), b in bound.items() if case == "decode"), bound  # all five, either family
assert mib["dense", "decode", "xla"] > mib["dense", "decode", "pallas"], mib  # the passes over the scan's slices
us = {(r["kernel"], r["case"], r["implementation"]): r["us"] for r in roof}
flop_per_byte = {(r["kernel"], r["case"], r["implementation"]): r["intensity"] for r in roof}
assert flop_per_byte["attention", "decode", "pallas"] > flop_per_byte["attention", "decode", "xla"], flop_per_byte
assert bound["dense", "prefill", "pallas"] == "compute" and us["dense", "prefill", "xla"] < 1.25 * us[
    "dense", "prefill", "pallas"], (bound, us)
assert all(bound[k, "prefill", "pallas"] == "compute" for k in ("attention", "moe_matmul")), bound
#
# ## 2. Measure and check at CPU size
#
# Each swap below runs the XLA twin (what the CPU uses) and the Pallas kernel on the same inputs at the
# `qwen3.5-mini` shapes, side by side (`qwen35_lib.bench`), on JAX's default backend (the next cell says which).
# On a TPU the kernel is compiled by Mosaic and runs for real. Elsewhere it runs in **interpret mode**: its time
# is that of an emulator and says nothing about a TPU; the measurement that counts there is the difference from
# the twin. Then the same Pallas kernel compiled for TPU7x at the 397B shapes.

# %%
assert jax.default_backend() == RT.twins, (jax.default_backend(), RT)  # setup started what it said
print(f"here: {RT.kernels} ({jax.devices()[0].device_kind})")

# %% [markdown]
#
# ### 2a. Ragged paged attention
#
# Two decodes of different contexts next to a prefill chunk that continues a sequence (the case's name gives the
# lengths), over a shuffled page pool: one kernel call for the whole ragged batch. Beside the Pallas kernel and the
# XLA twin runs `items`, the XLA attention the CPU serves with: it reads a page once per run of a sequence's tokens
# inside a block (`ITEM_BLOCK` tokens), where the twin reads it once per token.

# %%
from qwen35_lib.bench.kernels_attention import attention_rows

attn = attention_rows(cases={"2 decodes + a 40-token chunk": ([100, 300], [(20, 40)])}, repeats=1)
print(dict_table(attn, ("case", "implementation", "mode", "median_ms", "max_abs_diff_vs_xla")))
print(compiled("attention"))

# %% [markdown]
# **Check.** bf16 at mini size: each computes in float32 and rounds the output once to bf16, so they may differ
# from the twin by a bf16 ulp of an O(1) output (2^-7 at most); a wrong page or mask would be O(1).

# %%
by_impl = {r["implementation"]: r for r in attn}
assert ("interpret" in by_impl["pallas"]["mode"]) == (RT.pallas == "interpret")
assert all(r["max_abs_diff_vs_xla"] <= 2**-7 for r in attn), attn

# %% [markdown]
# Read the compile's temporaries against its arguments: a temporary the size of the page pool would mean the pool
# is copied on every call, which costs more than the pages the kernel avoids reading. A TPU stores an array in
# tiles that span its two minor dims, so a reshape of those dims is a copy. The pool is therefore stored as
# `kv [P, ps, 2 Hkv d]`, K and V of every head merged into one minor dim (`engine/cache.py`): the kernel DMAs its
# pages straight from it, and the KV write merges new rows into the pool's tiles in place. (Stored as
# `[P, ps, 2 Hkv, d]` and viewed as `[P, ps, 2 Hkv d]` by the kernel, the pool was relaid out on every call: a
# temporary the size of the pool in this compile.) The FP8 scales follow the same rule: stored `[P, ps, 2 Hkv]`
# float32, with a 4-wide minor dim, they were relaid out for the kernel on every call (a temporary the size of the
# scales). They are now stored token-minor, `kv_scale [P, 2 Hkv, ps]`: with pages of `ps = 256` a page's scales
# of one head are a
# lane-dense row, which the kernel DMAs as is and multiplies into the score (and probability) columns of those
# keys. The compile's temporaries are now small working buffers, no copy of either pool. Interpret mode cannot
# see such copies; the ahead-of-time compile does.

# %%
if aot is not None:
    row = next(r for r in aot.result() if r["kernel"] == "attention")
    P, ps = 64 * 9216 // 256 + 1, 256  # kb.tpu7x_compile_rows' pool: 64 sequences of 9216 tokens, pages of 256
    scale_bytes = P * 4 * ps * 4  # kv_scale [P, 2 Hkv = 4, ps] float32
    assert row["temp_bytes"] < scale_bytes / 8, row  # no copy of the scales (nor, a fortiori, of the pool)

# %% [markdown]
# ### 2b. Grouped GEMM (the MoE's experts)
#
# A few tokens (`tokens=16`) routed top-8 over 64 experts by a random router: their copies sorted by expert, most
# groups empty or of one row. The backend's default `moe_matmul` (the row names it: on the CPU `native`, a C++
# handler XLA calls; on a TPU, where the default is the Pallas kernel, `ragged_dot`) against the Pallas grouped
# GEMM, float32.

# %%
with float32():
    moe = kb.moe_rows(tokens=16, repeats=1, settle=0)
print(dict_table(moe, ("case", "implementation", "mode", "median_ms", "max_abs_diff_vs_xla")))
print(compiled("moe_matmul"))

# %%
assert moe[1]["implementation"] == "pallas" and moe[1]["max_abs_diff_vs_xla"] < 1e-5, moe  # float32, order only

# %% [markdown]
# ### 2c. Chunked gated delta rule
#
# The ragged protocol the engine uses: 4 decodes from their state slots next to two prompts in chunks of 64, one
# of them continuing mid-sequence from its slot, float32. On the CPU a third row times the native kernels, the CPU
# default (`kernels/gdn/native.py`: C++ handlers that run the recurrence token after token on each state in place).

# %%
from qwen35_lib.bench.kernels_gdn import gdn_rows

with float32():
    gdn = gdn_rows(cases=("mixed",), prefill_tokens=128, decode_batch=4, dtype="float32", repeats=1, settle=0)
print(dict_table(gdn, ("shape", "implementation", "mode", "median_ms", "max_abs_diff_vs_xla")))
print(compiled("gdn"))

# %%
assert gdn[1]["implementation"] == "pallas" and gdn[1]["max_abs_diff_vs_xla"] < 1e-5, gdn
assert all(r["max_abs_diff_vs_xla"] < 1e-5 for r in gdn[2:]), gdn  # the native row, on the CPU

# %% [markdown]
# ### 2d. Gather/scatter permutes
#
# Dispatch (sort the copies of `tokens=32` tokens by expert) then the weighted combine back, with an identity
# expert in
# between, so the result is each token times the sum of its routing weights. On TPU7x this is the SparseCores'
# job; our kernel is the TensorCore form, one DMA per row.

# %%
with float32():
    perm = kb.permute_rows(tokens=32, repeats=1, settle=0)
print(dict_table(perm, ("case", "implementation", "mode", "median_ms", "max_abs_diff_vs_xla")))
print(compiled("permute"))

# %%
assert perm[1]["implementation"] == "pallas" and perm[1]["max_abs_diff_vs_xla"] < 1e-5, perm
if aot is not None:
    assert all(r["mosaic"] for r in aot.result()), aot.result()  # every kernel lowered by Mosaic for TPU7x

# %% [markdown]
# The compiles above are real Mosaic lowerings: a block shape the TPU rejects or a VMEM budget overrun fails
# there, while interpret mode would have accepted it. (XLA's `cost_analysis()` of such a program is of little use
# for the kernel itself: it counts a Mosaic call by its operands, the whole page pool or slot pool, and by the
# FLOPs the kernel declares; the cost model's accounting in section 1 is the prediction.)
#
# ## 3. What the swap buys on TPU7x, according to the cost model
#
# <details><summary><b>Pop quiz.</b> Which components of a step should the swap make faster, and which should it
# leave alone, in the cost model's accounting?</summary>
#
# Faster: the routed experts (fewer bytes per expert parameter: the FP8 weight read once, in place, with no sliced
# or dequantized copy), attention (only each sequence's own pages) and GDN's decode (each state read and written
# in place), and the dense projections (each read in place by the Pallas projection, where XLA's dots read slices
# of the layer scan's stack). A little cheaper: the permutes around the grouped matmul (fewer passes over the routed
# rows, section 1). Unchanged: the engine's caches, updated in place in both (`cache_copies`: 0; the engine's layer
# scan addresses each layer's pages and slots as rows of one pool). The printout shows each.
# </details>
#
# **Predict.** The `kernels` stage is `hier_rs` with the Pallas kernels: the same layout, routing and collectives.
# Their difference, per component of a step, is what the kernels buy.

# %%
from qwen35_lib.costmodel.predict import predict
from qwen35_lib.costmodel.step import COMPONENTS
from qwen35_lib.stage_gain import gain_table, stage_gain

buys = {(st, wl): predict(stage=st, isl=isl, osl=osl, concurrency=512, roofline=False, band=st == "kernels")
        for st in ("hier_rs", "kernels") for wl, (isl, osl) in (("8k/1k", (8192, 1024)), ("1k/8k", (1024, 8192)))}
stages = {"kernels": notebook.add_totals(stage_gain("kernels", predictions=buys))}  # by component group, totals
print(gain_table(stages["kernels"]))
for wl in ("8k/1k", "1k/8k"):
    before, after = buys["hier_rs", wl], buys["kernels", wl]
    print(f"{wl}: ms per step by component (every one the model charges either stage):")
    for comp in COMPONENTS:
        b_s, a_s = before["breakdown_s"].get(comp, 0.0), after["breakdown_s"].get(comp, 0.0)
        if b_s or a_s:
            print(f"  {comp:<15} {b_s * 1e3:7.2f} -> {a_s * 1e3:7.2f}")
    print(f"  {'mean step':<15} {before['mean_step_s'] * 1e3:7.2f} -> {after['mean_step_s'] * 1e3:7.2f}")

# %% [markdown]
# **Why the routed experts get cheaper.** Not because fewer experts are read: a decode step of 512 requests hits
# every local expert of a device. What changes is the bytes each expert parameter costs in HBM traffic.
# `stage_gain.expert_bytes` reads them from the cost model's own accounting of one MoE layer (its weight bytes,
# separated from its row bytes by pricing a decode step of 512 requests and one of twice that).

# %%
from qwen35_lib.stage_gain import expert_bytes

experts = {st: expert_bytes(st) for st in ("hier_rs", "kernels")}
for st, e in experts.items():
    print(f"{st:<8} a 512-request decode step hits {e['experts_hit']:.2f} of {e['local_experts']} local experts; "
          f"HBM bytes per expert parameter {e['bytes_per_param']:.2f}")

# %% [markdown]
# **Check.** Every local expert is hit under both stages, so the routed experts' saving is the bytes per parameter:
# the kernel reads the one FP8 byte in place, and beside it the block scales this library's grouped matmul takes
# expanded along lanes (a few hundredths of a byte a parameter; `expert_scales` prices their expansion); XLA's path,
# as the TPU7x compile has it, moves `xla_tpu_fp8_expert_bytes` bytes a parameter (the figure printed above: the
# scan's sliced copy and its relayouts, a float32 scale broadcast over the weight, the dequantizing fusions, bf16
# relayouts, `ragged_dot`'s read). Attention is the other large saving: the ragged kernel reads each sequence's own
# pages, once, in FP8, where this library's XLA attention reads up to its group's longest context for every decode
# token and every item of `ITEM_BLOCK` prompt tokens and converts every value to float32 first (tens of bytes a value
# once compiled: the facts `xla_tpu_paged_attention_bytes`, `xla_tpu_items_attention_bytes`). Attention and the MoE
# make nearly all of the saving on both workloads; which of the two is larger depends on how much context the XLA
# attention reads for a step's prompt tokens. GDN's decode gains too, and the dense projections (read in place); the
# permutes cost less by the ratio of their passes (section 1), and neither stage copies a cache. The Pallas stage runs
# this library's MoE layer, not production's: no one-hot permutes and no per-row bookkeeping (`moe_rows`,
# production's), which the `tpu_inference_3050` stage carries (notebook 06).

# %%
for wl in ("8k/1k", "1k/8k"):
    before, after = buys["hier_rs", wl]["breakdown_s"], buys["kernels", wl]["breakdown_s"]
    assert after["routed_experts"] < before["routed_experts"] and after["attn_core"] < before["attn_core"]
    assert after["gdn_core"] < before["gdn_core"]
    assert permute_passes / 4 - 1e-6 <= after["permute"] / before["permute"] < 1  # section 1's passes, + the sums
    assert after["cache_copies"] == before["cache_copies"] == 0
    assert after["attn_proj"] < before["attn_proj"] and after["gdn_proj"] < before["gdn_proj"]  # read in place
    assert before["onehot_permute"] == before["moe_rows"] == after["onehot_permute"] == after["moe_rows"] == 0
    assert buys["kernels", wl]["total_tokens_per_s"] > buys["hier_rs", wl]["total_tokens_per_s"]
assert all(e["local_experts"] - e["experts_hit"] < 0.01 for e in experts.values()), experts  # every expert hit
assert 1 < experts["kernels"]["bytes_per_param"] < 1.05 and experts["hier_rs"]["bytes_per_param"] > 19, experts

# %% [markdown]
# **Claims.** What the chapter says of this step, each checked on this run (`notebook.claim_*`): which components
# make the saving, what an expert parameter costs, where GDN's gain comes from, what the dense projections cost
# under each, and that the layer priced here is this library's, not production's.

# %%
k = {wl: stages["kernels"][wl] for wl in ("8k/1k", "1k/8k")}
k_saved = {wl: k[wl]["saved_ms_per_1k_tokens"] for wl in k}
share = {wl: (v["attention"] + v["moe"]) / sum(v.values()) for wl, v in k_saved.items()}
notebook.claim("attention_and_moe_save", "attention and the MoE save {s8:.0%} of what the step saves on 8k/1k "
               "({a8:.0f} and {m8:.0f} ms per 1,000 tokens) and {s1:.0%} on 1k/8k ({a1:.0f} and {m1:.0f})",
               all(v > 0.9 for v in share.values()), "(attention + moe) / all saved > 0.9, both workloads",
               s8=share["8k/1k"], a8=k_saved["8k/1k"]["attention"], m8=k_saved["8k/1k"]["moe"], s1=share["1k/8k"],
               a1=k_saved["1k/8k"]["attention"], m1=k_saved["1k/8k"]["moe"])
notebook.claim_largest("moe_saves_most_1k8k", "on 1k/8k the MoE saves the most, {moe:.0f} ms per 1,000 tokens "
                       "against attention's {attention:.0f}", k["1k/8k"]["saved_ms_per_1k_tokens"], "moe")
notebook.claim_greater("expert_bytes", "an expert parameter costs {xla:.1f} bytes of HBM traffic on this library's "
                       "XLA path and {pallas:.2f} under the Pallas grouped matmul", xla=experts["hier_rs"][
                           "bytes_per_param"], pallas=experts["kernels"]["bytes_per_param"])
e = experts["kernels"]
notebook.claim_within("every_expert_hit", "a decode step of 512 requests hits {hit:.2f} of a device's {local} local "
                      "experts under either stage", e["local_experts"] - 0.01, e["local_experts"],
                      hit=min(x["experts_hit"] for x in experts.values()), local=e["local_experts"])
b, a = buys["hier_rs", "1k/8k"]["breakdown_s"], buys["kernels", "1k/8k"]["breakdown_s"]
notebook.claim("gdn_gains_in_its_kernel", "GDN gains in its decode kernel ({before:.1f} to {after:.1f} ms a step "
               "on 1k/8k) and in its projections, read in place ({proj_before:.1f} to {proj_after:.1f} ms)",
               a["gdn_core"] < b["gdn_core"] and a["gdn_proj"] < b["gdn_proj"], "gdn_core and gdn_proj fall",
               before=b["gdn_core"] * 1e3, after=a["gdn_core"] * 1e3, proj_before=b["gdn_proj"] * 1e3,
               proj_after=a["gdn_proj"] * 1e3)
from qwen35_lib import data as data_files

kfacts = data_files.read_json("costmodel_hardware.json")["kernels"]
dense = ("attn_proj", "gdn_proj", "shared_expert")
notebook.claim("dense_in_place", "the dense projections cost {before:.1f} ms a 1k/8k step on XLA's dots, which read "
               "each layer's weights in {xla_passes} passes as compiled, and {after:.1f} ms under the Pallas "
               "projection ({pallas_passes} passes)", sum(a[c] for c in dense) < sum(b[c] for c in dense)
               and kfacts["pallas_dense_weight_passes"]["value"] < kfacts["xla_weight_passes"]["value"],
               "the projections' time and weight passes fall", before=sum(b[c] for c in dense) * 1e3,
               after=sum(a[c] for c in dense) * 1e3, xla_passes=kfacts["xla_weight_passes"]["value"],
               pallas_passes=kfacts["pallas_dense_weight_passes"]["value"])
notebook.claim("this_librarys_moe", "the `kernels` stage is priced as this library's MoE layer, not production's: "
               "{onehot:.0f} ms of one-hot permutes and {rows:.0f} ms of per-row bookkeeping a step",
               a["onehot_permute"] == a["moe_rows"] == 0, "onehot_permute == moe_rows == 0",
               onehot=a["onehot_permute"] * 1e3, rows=a["moe_rows"] * 1e3)

# %% [markdown]
# ## 4. The whole 397B step fits a TPU7x-8: its compile
#
# <details><summary><b>Pop quiz.</b> Weights and caches fit, by placement's arithmetic. What else must fit in a
# device's HBM for the step to run, and which step is the tighter one, decode or mixed?</summary>
#
# The step's temporaries (activations, routed-row buffers, what the kernels stage in HBM) and its code, on top
# of the arguments; the compiler counts them all. The mixed step is tighter: its prefill chunk makes larger
# activations and MoE row buffers than a token per sequence does. The table below prints each step's total and
# its headroom under the usable HBM.
# </details>
#
# **Measure** (a compile, not a run). `make sweep` compiles the `kernels` stage's engine step for `tpu7x:2x2x1` at
# the serving shape: Qwen3.5-397B-A17B at full depth with abstract weights, 512 concurrent requests (64 sequences
# per rank), every request's whole context in an FP8 KV pool (the `shape` printed below), FP8 experts read in place
# by the grouped matmul; a decode step (every sequence decoding) and a mixed one (plus the recipe's prefill budget
# a rank). The
# compile takes minutes a step, so this notebook reads the stored result, `data/aot/tpu7x-8.json` (its command,
# versions and flags are recorded in it), and `make test` checks the sweep's code on a tiny model. XLA's own
# memory analysis gives each part per device; the usable HBM is the compiler's figure.

# %%
from qwen35_lib import data as data_files

sweep = data_files.read_json("aot/tpu7x-8.json")
fit = {name: {k: step[k] for k in ("weight_bytes", "kv_bytes", "gdn_state_bytes", "temp_bytes", "total_bytes",
                                   "headroom_bytes", "fits")}
       for name, step in sweep["stages"]["kernels"]["steps"].items()}
print(f"{sweep['model']}, {sweep['groups']} layer groups, {sweep['topology']}, jax {sweep['jax']}, "
      f"libtpu {sweep['libtpu']}; usable HBM {sweep['usable_bytes'] / 2**30:.2f} GiB per device")
print("shape:", sweep["shape"])
rows = [{"step": name, **{k: f"{v / 2**30:.2f} GiB" if k != "fits" else v for k, v in f.items()}}
        for name, f in fit.items()]
print(dict_table(rows, list(rows[0])))

# %% [markdown]
# **Check.** Every step fits with its temporaries counted: weights, caches and temporaries together stay under the
# usable HBM the compiler names. What else a running server keeps in HBM beside the compiled step (buffers of the
# runtime, a second program) a compile cannot see; the headroom printed above is what is left for it.

# %%
assert all(f["fits"] and f["total_bytes"] + f["headroom_bytes"] == sweep["usable_bytes"] for f in fit.values())
assert all(f["total_bytes"] > f["weight_bytes"] + f["kv_bytes"] + f["gdn_state_bytes"] for f in fit.values())

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(
    roofline=roof, cpu=attn + moe + gdn + perm, tpu7x_compile=aot.result() if aot is not None else [],
    gain={wl: buys["kernels", wl]["total_tokens_per_s"] / buys["hier_rs", wl]["total_tokens_per_s"]
          for wl in ("8k/1k", "1k/8k")},
    total_tokens_per_s={f"{st} {wl}": r["total_tokens_per_s"] for (st, wl), r in buys.items()}, stages=stages,
    fit_397b={name.replace(" ", "_"): f for name, f in fit.items()}, usable_bytes=sweep["usable_bytes"],
    expert_bytes=experts)
notebook.save_results("kernel_swaps", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> At serving shapes attention and the MoE are memory-bound under XLA, so the Pallas kernels win by
# not moving bytes (only valid pages; each FP8 expert weight read once, in place, where every expert is hit
# anyway) -- after checking that they compute
# what their XLA twins compute and that they lower for TPU7x.
# </div>
#
# ## What we learned
#
# - Place each op on the roofline before optimizing it: at serving shapes attention and the MoE sit far below the
#   ridge, so the only gain available is fewer bytes, not fewer FLOPs.
# - A Pallas kernel earns its place by what it does not read: invalid pages, sliced copies and a bf16 copy of FP8
#   weights. Skipping experts without tokens saves nothing at 512 requests: every local expert is hit.
# - Every kernel has an XLA twin; the kernel is right when it equals the twin here and compiles for TPU7x. Times in
#   interpret mode say nothing about a TPU.
# - The claim that the 397B step fits is a compile, temporaries included, not arithmetic over the weights.

# %% [markdown]
# ## Exercises
#
# 1. **[Ridge point]** At how many token copies per local expert does the grouped GEMM become compute-bound with
#    FP8 weights? With bf16 weights?
#    <details><summary>Answer</summary>
#
#    Each weight byte does `2 * rows` FLOPs per FP8 byte (`rows` per expert), so it crosses the ridge at
#    `rows ~ ridge / 2` copies per expert with FP8 and `~ ridge` with bf16 (2 bytes per weight). A decode step at
#    512 concurrent requests (a token each) gives `512 * 10 / 512 = 10` copies per expert: memory-bound by a
#    factor of `ridge / 20`, whatever the kernel.
#    `kb.roofline_rows(concurrency=...)` moves the decode point.
#    </details>
#
# 2. **[Uneven contexts]** Section 1's decode step has a mean context of half the longest. If the mean falls to a
#    tenth of the longest (9216), what happens to the bytes of XLA's attention and of the Pallas kernel?
#    <details><summary>Answer</summary>
#
#    XLA's fall less than the kernel's: a rank's decode tokens walk in groups of `WALK_ROWS` sorted by context, each
#    group to its own longest (`ops.walked_context`: the mean plus the gap to the longest over the groups), so a
#    rank's decodes still read a share of the gap. The kernel's fall with the mean, the contexts it really reads.
#    Check with `ops.attention_block(cfg, ops.Batch(decodes=512, decode_ctx=922, max_ctx=9216), pr)["attn_core"]`
#    for the pricings `costmodel.step.pricing(cfg, specs.get("tpu7x-8"), get_stage(stage),
#    kv_dtype="float8_e4m3fn")` of `hier_rs` and `kernels` (`cfg = costmodel.predict.serving_model()`).
#    </details>
#
# 3. **[Interpret mode]** On a CPU runtime the Pallas attention above ran faster than XLA in interpret mode. Does
#    that say anything about TPU speed?
#    <details><summary>Answer</summary>
#
#    No. Interpret mode runs the kernel's body as ordinary XLA:CPU operations (a loop over the grid); its time
#    depends on how the emulation maps to the CPU. The TPU-side claims rest on the cost model and the Mosaic
#    compile, and only a TPU measurement (`python -m qwen35_lib.bench kernels` on a TPU) could confirm them.
#    </details>
#
# 4. **[What the model does not credit]** The cost model gives the chunked GDN kernel no gain. What would it take
#    to credit one?
#    <details><summary>Answer</summary>
#
#    Counting what the kernel avoids: XLA's chunked scan writes the `[dk, dv]` state of every chunk and the
#    intermediate WY/UT terms to HBM, while the kernel keeps the state in VMEM across chunks. `ops.gdn_block`
#    charges both the same `2 * state` bytes per sequence plus the chunk's inputs, so adding XLA's per-chunk state
#    traffic (64 heads x 128 x 128 x 4 B per chunk) to the `xla` family would be the change.
#    </details>

# %% [markdown]
# **The answers, computed.** Each exercise's numbers, from this run, folded until you open them.

# %%
from qwen35_lib.costmodel import ops, specs
from qwen35_lib.costmodel.predict import serving_model
from qwen35_lib.costmodel.step import pricing
from qwen35_lib.plan import get_stage

ridge = roof[0]["ridge"]
cfg_s, tpu_s = serving_model(), specs.get("tpu7x-8")
copies = 512 * cfg_s.num_experts_per_tok / cfg_s.num_experts  # token copies per expert, a decode step of 512
notebook.answer(1, "the ridge is {ridge:.0f} FLOPs a byte: compute-bound from about {fp8:.0f} token copies per expert "
                "with FP8 weights ({ridge:.0f} / 2) and {bf16:.0f} with bf16; a decode step at 512 requests gives "
                "{copies:.0f}, memory-bound by {factor:.0f}x.", ridge=ridge, fp8=ridge / 2, bf16=ridge,
                copies=copies, factor=ridge / 2 / copies)
attn = {}
for st in ("hier_rs", "kernels"):
    pr = pricing(cfg_s, tpu_s, get_stage(st), kv_dtype="float8_e4m3fn")
    attn[st] = [ops.attention_block(cfg_s, ops.Batch(decodes=512, decode_ctx=ctx, max_ctx=9216), pr)[
        "attn_core"].hbm_bytes for ctx in (4608, 922)]
notebook.answer(2, "XLA's attention moves {x0:.2f} GiB a device at a mean context of half the longest and {x1:.2f} "
                "GiB at a tenth ({xratio:.0%} of it: each group of its tokens walks to its own longest); the Pallas "
                "kernel {p0:.2f} GiB then {p1:.2f} GiB ({ratio:.0%} of it).", x0=attn["hier_rs"][0] / 2**30,
                x1=attn["hier_rs"][1] / 2**30, xratio=attn["hier_rs"][1] / attn["hier_rs"][0],
                p0=attn["kernels"][0] / 2**30, p1=attn["kernels"][1] / 2**30,
                ratio=attn["kernels"][1] / attn["kernels"][0])
notebook.answer(3, "nothing: on this runtime the Pallas kernels ran in {mode} mode on {where}; the TPU7x figures are "
                "the cost model's and the Mosaic compile's.", mode=RT.pallas, where=RT.twins.upper())
chunk_state = cfg_s.gdn_num_v_heads * cfg_s.gdn_k_head_dim * cfg_s.gdn_v_head_dim * 4
notebook.answer(4, "XLA's chunked scan would add about {mib:.2f} MiB of state traffic per chunk of a sequence in each "
                "GDN layer ({heads} value heads x {dk} x {dv} x 4 bytes, written and read once per chunk).",
                mib=2 * chunk_state / 2**20, heads=cfg_s.gdn_num_v_heads, dk=cfg_s.gdn_k_head_dim,
                dv=cfg_s.gdn_v_head_dim)
