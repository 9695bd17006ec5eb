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
# # 04 · Collective fusion: two all-gathers instead of three, a reduce-scatter in two phases
#
# Token replication (notebook 03) costs, per MoE layer, three all-gathers and one reduce-scatter. Two of the
# all-gathers carry tiny arrays (the top-k ids and weights), so their cost is mostly the fixed latency of a
# collective; and the reduce-scatter crosses two very different links: the two TensorCores of a chip sit side by
# side, while chips talk over ICI. This notebook asks: can the ids and weights travel in one collective, can the
# reduce-scatter be split into an intra-chip phase and an inter-chip phase that overlap, and do both still compute
# exactly what they replace?

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/04_collective_fusion.ipynb)

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
# ## 0. What the two flags buy (the cost model, TPU7x-8)
#
# **Compute.** Two rungs of the ladder: `fused_ag` is `replicate` (notebook 03) with `fuse_allgather`, `hier_rs`
# is `fused_ag` with `hierarchical_rs`. Milliseconds per 1,000 tokens served by component, both workloads at 512
# concurrent requests (one prediction per stage and workload, shared by the two comparisons).

# %%
from qwen35_lib.stage_gain import gain_table, stage_gain

predictions = {}
stages = {name: stage_gain(name, predictions=predictions) for name in ("fused_ag", "hier_rs")}
for name in stages:
    print(gain_table(stages[name]))

# %% [markdown]
# **Check.** Neither flag changes the math: attention, GDN and the MoE cost the same. The fused all-gather saves
# collective time and helps on both workloads. The hierarchical reduce-scatter saves collective time on both too, but
# this engine pays for it in HBM: before its two phases it slices each micro-batch out of the combine's rows (the
# `glue` component, read off the stage's TPU7x compile, counted in "other"), and that costs about what the links
# save.

# %%
for name, rec in stages.items():
    for wl in ("8k/1k", "1k/8k"):
        change = rec[wl]["component_change"]
        assert all(abs(change[g]) < 1e-9 for g in ("attention", "gdn", "moe")), (name, wl, change)
        assert rec[wl]["saved_ms_per_1k_tokens"]["collectives"] > 0, (name, wl, change)
f, h = stages["fused_ag"], stages["hier_rs"]
assert all(f[wl]["gain"] > 1 and abs(f[wl]["saved_ms_per_1k_tokens"]["other"]) < 1e-9 for wl in ("8k/1k", "1k/8k"))
notebook.claim_greater("fusion_weighs_on_decode", "fusion saves a fixed latency per layer, which weighs more on the "
                       "small steps of the decode-heavy workload: {decode:+.2%} there against {prefill:+.2%} on 8k/1k",
                       decode=f["1k/8k"]["change"], prefill=f["8k/1k"]["change"])
links = {wl: h[wl]["saved_ms_per_1k_tokens"]["collectives"] for wl in ("8k/1k", "1k/8k")}  # ms per 1,000 tokens
slices = {wl: -h[wl]["saved_ms_per_1k_tokens"]["other"] for wl in ("8k/1k", "1k/8k")}
notebook.claim("hier_rs_links_against_slices", "the hierarchical reduce-scatter saves {l8:.3f} and {l1:.3f} ms of "
               "collectives per 1,000 tokens (8k/1k, 1k/8k), and this engine's micro-batch slices before its phases "
               "cost {s8:.3f} and {s1:.3f} ms of HBM traffic: net {n8:+.2%} and {n1:+.2%}",
               all(links[wl] > 0 and slices[wl] > 0 and h[wl]["change"] < 0 for wl in links),
               "links saved > 0, slices paid > 0, net < 0 on both",
               l8=links["8k/1k"], l1=links["1k/8k"], s8=slices["8k/1k"], s1=slices["1k/8k"], n8=h["8k/1k"]["change"],
               n1=h["1k/8k"]["change"])
changes = [rec[wl]["change"] for rec in stages.values() for wl in ("8k/1k", "1k/8k")]
notebook.claim("small_either_way", "both steps move the throughput by little on either workload: from {lo:+.2%} to "
               "{hi:+.2%}", max(abs(c) for c in changes) < 0.01, "every |change| < 1%", lo=min(changes),
               hi=max(changes))

# %% [markdown]
# ## 1. Three all-gathers become two
#
# `fuse_allgather` bitcasts the float top-k weights to int32 and packs them beside the int32 ids: one `[n, 2k]`
# int32 array, one all-gather, unpacked and bitcast back on arrival (`collectives.gather_routing`). Bit-exact.
#
# <details><summary><b>Pop quiz.</b> Packing the ids and the weights into one all-gather saves a collective. Does
# it also save bytes?</summary>
#
# No, it adds a few: the weights travel as 4-byte int32 words instead of bf16, so each copy of a token's routing
# grows by `2k` bytes. What it saves is the fixed latency of a collective, which is most of the cost of an
# all-gather this small. The compiled counts below show both, and why XLA:CPU shows no growth at all.
# </details>
#
# **Predict.** Per MoE layer: 3 all-gathers → 2 (per layer group of 4 MoE layers, 12 → 8). The bytes barely move:
# the weights travel as 4-byte words instead of bf16, `N·k·2` bytes more per layer, for one collective less.
#
# **Measure.** One MoE layer (`routing.moe_ep`, the function the model calls; `qwen3.5-tiny`, bf16, `N = 512`),
# compiled for the 8 CPU devices and for a TPU7x-8 (`tpu7x:2x2x1`). Notebook 02 read the same collectives out
# of a whole layer group of the engine's step.

# %%
import importlib.util

import jax

import qwen35_lib
from qwen35_lib import aot
from qwen35_lib.parallel import hlo
from qwen35_lib.plan import get_stage

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None  # the 'tpu' extra: ahead-of-time TPU7x compiles

layer_cfg = qwen35_lib.get_config("qwen3.5-tiny")  # bf16, the serving dtype
targets = {"CPU": mesh} | ({"TPU7x": aot.chip_core_mesh()} if HAVE_LIBTPU else {})
all_gathers = {}
for fused in (False, True):
    for where, m in targets.items():
        plan = get_stage("fused_ag" if fused else "replicate")  # dp8_ep8 + replicate, with and without the flag
        counts = hlo.count(aot.compile_moe_layer(layer_cfg, plan, m, 512).as_text())
        all_gathers[where, fused] = counts["all-gather"]
for (where, fused), v in all_gathers.items():
    print(f"{where:<6} fuse_allgather={fused!s:<5}: {v['count']} all-gathers, {v['bytes']:,} bytes")
if not HAVE_LIBTPU:
    print("libtpu not installed (pip install 'jax[tpu]'): skipped the TPU7x compiles")

# %% [markdown]
# **Check.** 3 → 2 on both compilers. On the TPU (bf16, `N = 512`, `k = 3`) the bytes grow by exactly `N·k·2`;
# XLA:CPU carries the bf16 weights in float32 already, so there the bytes do not change at all.

# %%
k = layer_cfg.num_experts_per_tok
for where in targets:
    off, on = all_gathers[where, False], all_gathers[where, True]
    assert (off["count"], on["count"]) == (3, 2), (where, off, on)
    assert on["bytes"] - off["bytes"] == (512 * k * 2 if where == "TPU7x" else 0), (where, off, on)

# %% [markdown]
# ## 2. The reduce-scatter in two phases
#
# After the local experts, every device holds partial sums `{y[N, D]}_U` for all `N` tokens; each token's owner
# needs the sum. A flat `psum_scatter` over `('chip', 'core')` does it in one collective. The hierarchical
# version (`hierarchical_rs`) does it in two: first over `core` (the 2 TensorCores of a chip exchange halves:
# intra-chip), then over `chip` (4 chips exchange quarters of what is left: inter-chip), and splits the rows
# into micro-batches so that one micro-batch's inter-chip phase can run while the next one's intra-chip phase is
# in flight.
#
# **The row-order subtlety.** A scatter over `core` hands core `j` the `j`-th half of the rows; the one over
# `chip` then hands chip `c` the `c`-th quarter of that half. Device `(c, j)` ends with block `4j + c` of 8, but
# the flat scatter (and the data-parallel layout of the tokens) puts block `2c + j` there. So either the rows are
# permuted first (view the 8 blocks as `[chip 4, core 2]` and transpose to `[core, chip]`: a copy), or the tokens
# are laid out in the scatter's order from the start: the engine gathers them over `('core', 'chip')`
# (`collectives.token_axes`), so block `4j + c` is device `(c, j)`'s own and nothing is copied. Watch the permute
# happen, with rows numbered by the block they belong to.
#
# <details><summary><b>Pop quiz.</b> Without the permute, which devices still end with their own block?</summary>
#
# Those where `4j + c = 2c + j`, that is `c = 3j`: devices `(0, 0)` and `(3, 1)`, the first and the last. The
# other six hold another device's tokens, so the hierarchical version would still sum correctly but hand the
# sums to the wrong owners. The printout's `core, then chip` line shows that order, the next one the fix.
# </details>

# %%
import numpy as np

from qwen35_lib.parallel.collectives import on_each_device, reduce_scatter
from qwen35_lib.plan import ALL

N, D = 64, 16
blocks = np.repeat(np.arange(8), N // 8).astype(np.float32)  # row r belongs to block r // 8
x = np.broadcast_to(blocks[:, None], (N, D)) * np.ones((8, 1, 1), np.float32)  # [device, N, D]: same on each

per_device = lambda fn: on_each_device(fn, x, mesh)  # [8, N / 8, D]: fn(x[i]) on device i

flat = per_device(lambda v: jax.lax.psum_scatter(v, ALL, scatter_dimension=0, tiled=True))
naive = per_device(lambda v: jax.lax.psum_scatter(jax.lax.psum_scatter(v, "core", scatter_dimension=0, tiled=True),
                                                  "chip", scatter_dimension=0, tiled=True))
hier = per_device(lambda v: reduce_scatter(v, hierarchical=True, micro_batches=2))
block_of = lambda out: (out[:, 0, 0] / 8).astype(int).tolist()  # each device's block id (sums of 8 copies)
print("device (chip, core):     ", [(c, j) for c in range(4) for j in range(2)])
print("flat psum_scatter:       ", block_of(flat))
print("core, then chip (naive): ", block_of(naive))
print("hierarchical_rs:         ", block_of(hier))

# %% [markdown]
# **Check.** On random data (each device its own partial sums), `hierarchical_rs` equals `psum_scatter` over
# `('chip', 'core')` for 1, 2 and 4 micro-batches; in float32 up to summation order (the two-phase sum adds the
# 8 partials in a different order: relative differences of order 1e-7).

# %%
assert block_of(flat) == list(range(8)) and block_of(hier) == list(range(8))
assert block_of(naive) == [4 * j + c for c in range(4) for j in range(2)]
x = np.random.default_rng(0).standard_normal((8, N, D)).astype(np.float32)
flat = per_device(lambda v: jax.lax.psum_scatter(v, ALL, scatter_dimension=0, tiled=True))
for m in (1, 2, 4):
    np.testing.assert_allclose(per_device(lambda v, m=m: reduce_scatter(v, True, m)), flat, rtol=1e-5, atol=1e-6)
print("hierarchical_rs == psum_scatter for 1, 2, 4 micro-batches")

# %% [markdown]
# ### Do the phases overlap? The TPU7x schedule
#
# <details><summary><b>Pop quiz.</b> The code issues micro-batch 0's two phases, then micro-batch 1's. What has to
# be true of the compiled program for the intra-chip phase of micro-batch 1 to run while micro-batch 0 is still
# crossing chips?</summary>
#
# The phases must be asynchronous collectives (a start and a done, work in between) on a unit that runs beside the
# TensorCore, and the scheduler must place micro-batch 1's start before micro-batch 0's done. On TPU7x the
# **SparseCores** run such collectives: XLA offloads the reduce-scatters to them by default. Production's published
# recipe turns that offload off (`--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=false`, with its own
# SparseCore reduce-scatter kernel behind a switch the benchmarked script leaves off: notebook 08).
# </details>
#
# **Measure** (a compile). One MoE layer of `hier_rs` (`qwen3.5-mini`'s hidden size, `N = 256`: the 2
# micro-batches the code uses) compiled for `tpu7x:2x2x1` twice: as XLA does by default, and with the offload
# flag off. The scheduled HLO lists each collective's start and done in the order they run
# (`aot.hlo_checks.rs_chains`: each micro-batch's phase 1 over `core` paired with its phase 2 over `chip`).

# %%
from qwen35_lib.aot import hlo_checks

SC_OFFLOAD = "xla_tpu_enable_sparse_core_collective_offload_reduce_scatter"
schedules = {}
if HAVE_LIBTPU:
    rs_cfg = qwen35_lib.get_config("qwen3.5-mini", num_experts=8, vocab_size=256)
    for label, opts in (("default (SparseCore offload)", None), ("offload off", {SC_OFFLOAD: "false"})):
        text = aot.compile_moe_layer(rs_cfg, get_stage("hier_rs"), aot.chip_core_mesh(), 256, opts).as_text()
        entry = next(ln.split()[1].lstrip("%") for ln in text.splitlines() if ln.startswith("ENTRY"))
        chains = hlo_checks.rs_chains(text, entry)
        schedules[label] = dict(overlapped=hlo_checks.overlapped(chains, len(chains))[0],
                                how=sorted({a.how for pair in chains for a in pair}),
                                chains=[[(a.start, a.done) for a in pair] for pair in chains])
        print(f"{label:<29} {schedules[label]['how']}: (phase 1 start, done), (phase 2 start, done) per "
              f"micro-batch {schedules[label]['chains']}; overlapped: {schedules[label]['overlapped']}")
else:
    print("libtpu not installed (pip install 'jax[tpu]'): skipped the TPU7x schedule")

# %% [markdown]
# **Check.** By default both phases run on the SparseCore and micro-batch 1 starts before micro-batch 0's second
# phase is done: they overlap. With the offload off, each phase is a synchronous TensorCore op in program order,
# and nothing overlaps: the split saves inter-chip bytes but no longer hides them.
# (`tests/integration/test_tpu_overlap.py` checks the same on the whole step, with a serialised control that must fail.)

# %%
if schedules:
    on, off = schedules["default (SparseCore offload)"], schedules["offload off"]
    assert on["how"] == ["sparsecore"] and on["overlapped"], on
    assert off["how"] == ["sync"] and not off["overlapped"], off

# %% [markdown]
# ## 3. Bytes per phase
#
# <details><summary><b>Pop quiz.</b> Does the two-phase reduce-scatter send more bytes than the flat one? And what
# share of them crosses chips?</summary>
#
# The same bytes in all, `1/2 + 3/8 = 7/8` of a device's input, but only `3/8` of it crosses chips: phase 1
# halves the rows inside the chip before anything reaches ICI. The compiled shapes below give each phase's rows,
# and the bytes follow from them.
# </details>
#
# **Predict.** A device starts with `N·D·b` bytes of partial sums. Phase 1 (over `core`) sends half of them to the
# other core of its chip: `N·D·b / 2` intra-chip, leaving `N/2` rows. Phase 2 (over `chip`) is a reduce-scatter
# of those among 4 chips: `3/4 · N/2 · D·b = 3/8 · N·D·b` inter-chip. The flat reduce-scatter sends
# `7/8 · N·D·b`, all over whatever links the 8-device ring uses. With `m` micro-batches each phase runs `m` times
# on `1/m` of the rows.
#
# **Measure.** The collectives of the compiled two-phase reduce-scatter (result shapes say which phase: `N/2`
# rows after phase 1, `N/8` after phase 2), on the CPU and for TPU7x.

# %%
from qwen35_lib.parallel.collectives import reduce_scatter_ops

phases = {name: reduce_scatter_ops(m, micro_batches=2, rows=512, cols=4096) for name, m in targets.items()}
for name, ops in phases.items():
    print(name, [(op.kind, op.shape.split("{")[0]) for op in ops])

# %% [markdown]
# **Check.** Two micro-batches, two phases each: reduce-scatters whose results are `N/2/2 = 128` rows (phase 1)
# and `N/8/2 = 32` rows (phase 2). (XLA:CPU carries bf16 reductions in float32.)

# %%
for name, ops in phases.items():
    rows = sorted(int(op.shape.split("[")[1].split(",")[0]) for op in ops)
    assert rows == [32, 32, 128, 128], (name, rows)

# %% [markdown]
# **Compute.** From those row counts, the bytes each device sends per phase for the 397B at `N = 512` (bf16);
# then per chip, what leaves the chip: flat, each of its 2 cores sends 6 of its 8 blocks to the other chips' cores;
# hierarchical, only phase 2 leaves the chip. And the row permute the hierarchical version adds: a reorder of the
# whole `N x D` buffer on each device, read and written once, before any byte moves (a copy, not a collective).

# %%
from jax.sharding import AbstractMesh

from qwen35_lib.costmodel import specs as hw_specs
from qwen35_lib.costmodel import traffic
from qwen35_lib.plan import AXES, get_stage
from qwen35_lib.report import human_bytes

big = qwen35_lib.get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn")

Nb = 512 * big.hidden_size * 2  # N·D·b, bf16
per_phase = {"intra-chip (core)": Nb / 2, "inter-chip (chip)": 3 * Nb / 8, "flat, 8 devices": 7 * Nb / 8}
print({k: human_bytes(v) for k, v in per_phase.items()})
cores = 2
per_chip = {"flat": cores * 6 * Nb / 8, "hierarchical": cores * per_phase["inter-chip (chip)"]}  # leaving a chip
tpu7x = hw_specs.get("tpu7x-8")
row_permute = dict(bytes=2 * Nb, us=2 * Nb / tpu7x.hbm_bytes_per_s * 1e6)  # read + write, at one device's HBM rate
print("leaving each chip per MoE layer:", {k: human_bytes(v) for k, v in per_chip.items()})
print(f"row permute per device per MoE layer: {human_bytes(row_permute['bytes'])} read and written, "
      f"{row_permute['us']:.1f} us at {tpu7x.hbm_bytes_per_s / 1e12:.2f} TB/s")
moe_ops = traffic.moe_layer_ops(get_stage("hier_rs").bind(AbstractMesh((4, 2), AXES)), big, 512)
print("the cost model's MoE-layer ops under hier_rs:", sorted({op.kind for op in moe_ops}))

# %% [markdown]
# **Check.** The hierarchical reduce-scatter halves what leaves each chip; a row permute would move no byte between
# devices, and the cost model's ops for the layer hold collectives only (the engine needs no permute: its tokens are
# gathered in the scatter's order).

# %%
assert per_chip["hierarchical"] * 2 == per_chip["flat"]
assert {op.kind for op in moe_ops} <= {"all-gather", "reduce-scatter"}, moe_ops

# %%
import matplotlib.pyplot as plt

# figure: rs_phases
fig, ax = plt.subplots(figsize=(6.5, 2.4), layout="constrained")
ax.barh(["flat", "hierarchical"], [0, Nb / 2 / 2**20], color="#8172B2", label="intra-chip (core)")
ax.barh(["flat", "hierarchical"], [7 * Nb / 8 / 2**20, 3 * Nb / 8 / 2**20], left=[0, Nb / 2 / 2**20],
        color="#C44E52", label="inter-chip (chip) / mixed")
ax.set_xlabel("MiB sent per device, one MoE layer, N = 512 (397B, bf16)")
ax.legend(fontsize=8, loc="lower right")
plt.show()

# %% [markdown]
# The hierarchical version sends the same bytes in all (`1/2 + 3/8 = 7/8`), but only `3/8` of them cross the
# chip-to-chip links, the scarce ones on a 2x2x1 slice, and the intra-chip half overlaps the
# inter-chip phase of the previous micro-batch. The cost model (notebook 06) turns these bytes into time.
#
# ### The whole 397B step, compiled for TPU7x
#
# <details><summary><b>Pop quiz.</b> The 397B model has 60 MoE layers. How many all-gathers and reduce-scatters
# should XLA's TPU program of one decode step hold under `replicate`, `fused_ag` and `hier_rs`?</summary>
#
# Three all-gathers per MoE layer under `replicate`, two under the fused stages, so 180 and 120; one reduce-scatter
# per layer, and under `hier_rs` two phases for each of two micro-batches, four per layer. The stored compile
# below has them, with the cost model's bytes beside XLA's.
# </details>
#
# **Measure** (a compile, not a run). The stored sweep (`data/aot/tpu7x-8.json`, `make sweep`) compiled each stage's
# engine step for `tpu7x:2x2x1` at the serving shape: full depth, 512 requests, FP8 experts. Each step's collectives
# per kind, as XLA scheduled them, beside the cost model's closed form (`model_*`, computed when the sweep ran).

# %%
from qwen35_lib import data as data_files

stored = data_files.read_json("aot/tpu7x-8.json")
compiled = {}
for st in ("replicate", "fused_ag", "hier_rs"):
    for step in ("8k/1k decode", "8k/1k mixed"):
        c = stored["stages"][st]["steps"][step]["collectives"]
        compiled[st, step] = {k: c.get(k, {}) for k in ("all-gather", "reduce-scatter", "all-reduce")}
        print(f"{st:<10} {step:<13} " + "; ".join(
            f"{k}: {v.get('count', 0)} ({human_bytes(v.get('bytes', 0))}), model {v.get('model_count', 0)} "
            f"({human_bytes(v.get('model_bytes', 0))})" for k, v in compiled[st, step].items()))
mixed = stored["stages"]["hier_rs"]["steps"]["8k/1k mixed"]
mixed_rows = dict(decode=mixed["decode_tokens_per_rank"], prefill=mixed["prefill_tokens_per_rank"])
print(f"the mixed step, per rank: {mixed_rows['decode']} decode rows + {mixed_rows['prefill']} prompt tokens")

# %% [markdown]
# **Check.** In both steps XLA keeps what the code asks for: 3 all-gathers a MoE layer become 2, and the
# hierarchical reduce-scatter runs two phases per micro-batch, 2 micro-batches at decode and 8 in the mixed step
# (tpu-inference's rule for the step's token count), each kind's count and bytes the cost model's; the sampler's two
# small all-reduces are the only other collectives. The mixed step is compiled as the engine forms it, its decodes
# in the engine's power-of-two decode bucket (printed below). An earlier sweep compiled the decodes unbucketed, one
# row short of a whole 8-row tile a device, and there XLA's TPU compiler turned every reduce-scatter into an
# all-reduce plus small permutes and the hierarchical stage fell back to one micro-batch; padded to whole tiles, the
# same step kept its reduce-scatters (both compiles are in the repository's history, issue 30).

# %%
moe_layers = big.num_layers
for st, ags, rss in (("replicate", 3, (1, 1)), ("fused_ag", 2, (1, 1)), ("hier_rs", 2, (4, 16))):
    for step, rs in zip(("8k/1k decode", "8k/1k mixed"), rss):
        c = compiled[st, step]
        assert c["all-gather"]["count"] == ags * moe_layers == c["all-gather"]["model_count"], (st, step, c)
        assert c["reduce-scatter"]["count"] == rs * moe_layers == c["reduce-scatter"]["model_count"], (st, step, c)
        for k in ("all-gather", "reduce-scatter"):
            assert abs(c[k]["bytes"] - c[k]["model_bytes"]) <= 0.01 * c[k]["model_bytes"], (st, step, k, c[k])
        assert c["all-reduce"]["count"] == c["all-reduce"]["model_count"] == 2, (st, step, c)  # the sampler's
d, p = mixed_rows["decode"], mixed_rows["prefill"]
assert (d + p) % 8 == 0 and d & (d - 1) == 0, mixed_rows  # a power-of-two bucket; whole 8-row tiles a device

# %% [markdown]
# ## 4. The whole MoE layer, fused and hierarchical, still the same function
#
# **Check.** One MoE layer on the 8 CPU devices (`qwen3.5-tiny`, float32): plain replication, with
# `fuse_allgather`, and with both flags, against each other.

# %%
import jax.numpy as jnp

from qwen35_lib.model.moe import route
from qwen35_lib.parallel import shard_weights
from qwen35_lib.parallel.routing import moe_ep

tiny = qwen35_lib.get_config("qwen3.5-tiny", dtype="float32")
weights = qwen35_lib.init_weights(tiny, 0)
tokens = jnp.asarray(np.random.default_rng(1).standard_normal((64, tiny.hidden_size)), jnp.float32)
outs = {}
for flags in ({}, {"fuse_allgather": True}, {"fuse_allgather": True, "hierarchical_rs": True}):
    plan = get_stage("replicate").replace(**flags).bind(mesh, tiny)  # the plan, bound once, handed down
    w = jax.tree.map(lambda a: a[0, 0], shard_weights(tiny, plan, weights, mesh)["layers"]["moe"])
    with jax.set_mesh(mesh):
        outs[tuple(flags)] = np.asarray(jax.jit(lambda w, x, p=plan: moe_ep(tiny, w, x, route, p)[0])(w, tokens))
plain = outs[()]
assert np.array_equal(outs[("fuse_allgather",)], plain)  # packing is bit-exact
np.testing.assert_allclose(outs[("fuse_allgather", "hierarchical_rs")], plain, rtol=1e-5, atol=1e-6)
print({k or ("plain",): float(np.abs(v - plain).max()) for k, v in outs.items()})

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(all_gathers={f"{where}, fuse_allgather={fused}": v for (where, fused), v in all_gathers.items()},
              all_gather_count={f"{where}_{'fused' if fused else 'unfused'}": v["count"]
                                for (where, fused), v in all_gathers.items()},
              reduce_scatter_rows={k: [op.shape.split("{")[0] for op in v] for k, v in phases.items()},
              bytes_per_phase_397b_n512=per_phase, stages=stages, bytes_leaving_chip_397b_n512=per_chip,
              row_permute_397b_n512=row_permute, mixed_rows=mixed_rows,
              rs_schedule={k.split()[0]: v["overlapped"] for k, v in schedules.items()},
              sweep={f"{st}_{step.split()[1]}": {k.replace("-", "_"): v.get("count", 0) for k, v in c.items()}
                     for (st, step), c in compiled.items()})  # collective counts of the stored TPU7x compiles
notebook.save_results("collective_fusion", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> Packing ids and weights saves one collective per MoE layer for a few extra bytes, and splitting
# the reduce-scatter by link (core, then chip, the tokens in that order) keeps more than half of its traffic inside the
# chip, where it can overlap the inter-chip phase, with the same result.
# </div>
#
# ## What we learned
#
# - A collective has a fixed cost as well as a cost per byte. When the payload is tiny, as top-k ids and weights
#   are, merging collectives wins even if it adds bytes.
# - A reduce-scatter can be split by link: first over the fast one (`core`, inside a chip), then over the scarce
#   one (`chip`), so the scarce link carries less; micro-batches let the two phases overlap.
# - Composing collectives composes their block orders: a scatter over `core` then `chip` is a permutation of the
#   flat one, so the rows are permuted first, or the tokens laid out in the scatter's order (the engine's choice),
#   or the phases swapped (at the price of inter-chip bytes).
# - Every rewrite of a collective must compute the same function, and the check says how exactly: packing is
#   bit-exact, a two-phase sum changes only the order of float additions.

# %% [markdown]
# ## Exercises
#
# 1. **[Reverse the order]** Instead of permuting rows, reduce-scatter over `chip` first, then over `core`. Which
#    block does device `(c, j)` end with, and what does each phase send?
#    <details><summary>Answer</summary>
#
#    Over `chip` first, chip `c` keeps quarter `c`; then core `j` keeps half `j` of it: block `2c + j`, the right
#    one, with no permute. But now the first phase (`3/4 · N·D·b`) crosses chips and the second (`1/8 · N·D·b`)
#    stays inside: most traffic on the slow links, which is why the library keeps `core` first and lays the tokens
#    out in that order instead.
#    </details>
#
# 2. **[Micro-batches]** With `m` micro-batches and perfect overlap, how long does the two-phase scatter take,
#    if the phases take `t1` and `t2` unsplit?
#    <details><summary>Answer</summary>
#
#    About `max(t1, t2) + min(t1, t2) / m` (a pipeline of `m` stages), plus `m` times a collective's fixed
#    latency: `qwen35_lib.costmodel.collectives.hierarchical_reduce_scatter` models exactly this.
#    </details>
#
# 3. **[Bytes for one collective less]** At what `N` does the fused all-gather's extra `N·k·2` bytes cost more
#    than the latency of the collective it saves? Take the TPU7x-8 figures the cost model uses,
#    `costmodel.specs.get("tpu7x-8")`: `collective_launch_s + 7 * hop_latency_s` for the latency, the slowest
#    ring link (`ring_link_bytes_per_s * eff_ici`, both directions) for the bytes.
#    <details><summary>Answer</summary>
#
#    Solve `N·k·2 · 7/8 / (2 · bw) = latency` for `N` with those figures: the answer is far beyond any step here
#    (compare the token budget of a step), so fusing always pays.
#    </details>

# %% [markdown]
# **The answers, computed.** Each exercise's numbers, from this run, folded until you open them.

# %%
from qwen35_lib.costmodel import collectives as cm_collectives

notebook.answer(1, "block 2c + j, no permute; but the chip phase sends 3/4 of N·D·b = {cross:.2f} MiB a device "
                "across chips and the core phase 1/8 = {inside:.2f} MiB inside one (397B, N = 512), where the permuted "
                "order sends {perm:.2f} MiB across chips.", cross=3 * Nb / 4 / 2**20, inside=Nb / 8 / 2**20,
                perm=per_phase["inter-chip (chip)"] / 2**20)
rs = {m: cm_collectives.hierarchical_reduce_scatter(tpu7x, Nb, m).seconds * 1e6 for m in (1, 2, 4, 8)}
notebook.answer(2, "for the 397B layer at N = 512 on TPU7x-8 the cost model gives {m1:.1f} us unsplit, {m2:.1f} with 2 "
                "micro-batches, {m4:.1f} with 4 and {m8:.1f} with 8 (the shorter phase hidden behind the longer, "
                "a fixed latency added per micro-batch).", m1=rs[1], m2=rs[2], m4=rs[4], m8=rs[8])
latency = tpu7x.collective_launch_s + 7 * tpu7x.hop_latency_s
bw = tpu7x.ring_link_bytes_per_s * tpu7x.eff_ici
n_even = latency * 2 * bw / (big.num_experts_per_tok * 2 * 7 / 8)
notebook.answer(3, "N = {n:,.0f} tokens a step, from a latency of {lat:.1f} us and a ring link of {bw:.0f} GB/s: far "
                "beyond any step's token budget, so fusing always pays.", n=n_even, lat=latency * 1e6, bw=bw / 1e9)
