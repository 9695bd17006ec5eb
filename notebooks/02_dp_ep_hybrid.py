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
# # 02 · The DP+EP hybrid: 8-way attention data parallelism, 8-way expert parallelism
#
# Notebook 01 ended with the fix the error message named: stop splitting attention by head, and split it by
# request. Each of the 8 devices runs attention and Gated DeltaNet for its own requests with whole heads, and the
# 512 experts are split 64 per device. Attention then needs no communication at all; the MoE does, because a
# token's 10 experts live on other devices. This notebook asks: what lives where, which collectives does one layer
# run, and does the model still compute the same thing?

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/02_dp_ep_hybrid.ipynb)

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
import jax.numpy as jnp
import numpy as np

import qwen35_lib
from qwen35_lib import aot
from qwen35_lib.engine.engine import Engine, EngineConfig
from qwen35_lib.engine.sampling import SamplingParams
from qwen35_lib.parallel import get_layout, hlo, make_mesh, shard_weights
from qwen35_lib.parallel.parallelism import lower_forward  # `forward`'s program, to compile and inspect
from qwen35_lib.placement import fmt_range, placement
from qwen35_lib.viz.sharding_explorer import placement_figure

mesh = make_mesh()
big = qwen35_lib.get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn", gdn_state_dtype="bfloat16")
tiny = qwen35_lib.get_config("qwen3.5-tiny", dtype="float32")  # numeric checks: float32, seconds on a CPU
print(get_layout("dp8_ep8").summary)

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
# **Predict.** Replicating the dense weights costs memory (7 extra copies of everything that is not a routed
# expert), but attention and GDN become purely local: no collective in the mixer. The MoE needs, per layer: the
# tokens of all devices (all-gather `x`), their top-k expert ids and weights (two more all-gathers), and the
# partial outputs summed back to their owners (one reduce-scatter).

# %%
p = placement(big, "dp8_ep8", requests=512, context_len=8192)
for d in (0, 1, 7):
    dev = p.per_device[d]
    print(f"device {d} (chip {dev.chip}, core {dev.core}): experts {fmt_range(dev.holds['experts'])}, "
          f"KV heads {fmt_range(dev.holds['kv_heads'])}, requests {fmt_range(dev.holds['requests'])}")
print(p.summary())

# %%
placement_figure(p)

# %% [markdown]
# **Check.** 64 whole experts per device, both KV heads on every device, every 8th request.

# %%
assert all(len(d.holds["experts"]) == 64 and len(d.holds["kv_heads"]) == 2 for d in p.per_device)
assert sorted(r for d in p.per_device for r in d.holds["requests"]) == list(range(512))
assert p.fits

# %% [markdown]
# ## 2. Same model, same logits
#
# **Predict.** Sharding changes where the work happens, not what is computed: the logits under `dp8_ep8` equal the
# single-device model's, in float32, up to summation order (the reduce-scatter adds the 8 devices' partial sums in
# its own order: differences of order 1e-6 relative at most).
#
# **Measure.** Nine prompts of different lengths, right-padded into one batch. The sharded forward is compiled
# once with `.lower(...).compile()` so that the same executable also gives us its HLO in section 3.

# %%
rng = np.random.default_rng(0)
lengths = np.array([3, 16, 7, 12, 1, 9, 16, 5, 11], np.int32)
ids = np.zeros((9, 16), np.int32)
for i, n in enumerate(lengths):
    ids[i, :n] = rng.integers(2, tiny.vocab_size, size=n)
weights = qwen35_lib.init_weights(tiny, 0)
dp_cfg = tiny.replace(layout="dp8_ep8")
with jax.default_matmul_precision("highest"):
    reference = np.asarray(qwen35_lib.forward(tiny, weights, ids, lengths))  # one device
    with jax.set_mesh(mesh):
        sharded_weights = shard_weights(dp_cfg, weights, mesh)
        forward_dp = lower_forward(dp_cfg, sharded_weights, ids, lengths).compile()
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
# **Predict.** The decoder scans over layer groups (3 GDN layers + 1 attention layer, each followed by the MoE);
# the scan's loop body is one computation in the optimized HLO. Under `dp8_ep8` with `replicate` routing, one
# group should move, per MoE layer, with `N` tokens in the step (all ranks together), `k` experts per token:
#
# | collective | array | bytes (of the result, per device) |
# |---|---|---|
# | all-gather | hidden states `x[N_x, D] -> x[N, D]` | `N · D · 2` (bf16) |
# | all-gather | top-k ids `[N_x, k] -> [N, k]` | `N · k · 4` (int32) |
# | all-gather | top-k weights `[N_x, k] -> [N, k]` | `N · k · 2` (bf16) |
# | reduce-scatter | partial outputs `{y[N, D]}_U -> y[N_x, D]` | `N / 8 · D · 2` |
#
# and nothing for attention or GDN: `4 x 3 = 12` all-gathers and `4` reduce-scatters per group. We compile the
# engine's step (`aot.compile_step`: abstract weights and caches, 8 decode tokens per rank, so `N = 64`; 8 layers,
# i.e. 2 groups, since XLA unrolls a scan of length 1) for this
# machine's 8 CPU devices and, with libtpu, for a TPU7x-8 (`tpu7x:2x2x1`). Both in bf16, the serving dtype, with
# the XLA kernels of the `dp_ep` stages (Pallas kernels are notebook 05's subject).

# %%
step_cfg = qwen35_lib.get_config("qwen3.5-tiny", num_layers=8, layout="dp8_ep8", attention_kernel="xla",
                                 gdn_kernel="xla", moe_kernel="ragged_dot")
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None  # the 'tpu' extra
targets = {"CPU": (make_mesh(), step_cfg.replace(moe_kernel="auto"))}
if HAVE_LIBTPU:
    targets["TPU7x"] = (aot.chip_core_mesh(), step_cfg)
else:
    print("libtpu not installed (pip install 'jax[tpu]'): skipped the TPU7x compile")
per_group, body_ops = {}, {}
for name, (m, c) in targets.items():
    text = aot.compile_step(c, m, requests=16, context_len=256, decode=8).as_text()
    body = hlo.layer_body(text)
    per_group[name] = hlo.count(text, body)
    body_ops[name] = [op for op in hlo.collectives(text) if op.computation in hlo.called(text, body)]
    print(f"{name}, one layer group: {per_group[name]}")
for op in body_ops["CPU"][:5]:
    print(f"  CPU  {op.kind:<15} {op.bytes:>6} B  {op.shape}")
for op in body_ops.get("TPU7x", [])[:4] + [o for o in body_ops.get("TPU7x", []) if o.bytes > 4][-1:]:
    print(f"  TPU7x {op.kind:<14} {op.bytes:>6} B  {op.shape}")

# %% [markdown]
# **Check.** Both compilers keep the 12 all-gathers per group. The CPU keeps the 4 reduce-scatters (and carries
# bf16 collectives in float32, so its bytes are doubled); XLA's TPU compiler, at this tiny size, turns each
# reduce-scatter into an all-reduce of the whole `[N, D]` partial sums (each device then keeps its slice): the
# same data dependency, with a result 8x the size of the reduce-scatter's, a choice it makes for small arrays. A
# scalar all-reduce (1 or 4 bytes), where one appears, carries a loop condition the devices agree on, not the
# model's data. On the TPU the bytes are the table's.

# %%
N, D, k = 64, step_cfg.hidden_size, step_cfg.num_experts_per_tok
big_ones = lambda ops, kind: [o.bytes for o in ops if o.kind == kind and o.bytes > 4]
assert per_group["CPU"]["all-gather"]["count"] == 12 and per_group["CPU"]["reduce-scatter"]["count"] == 4
assert sorted(big_ones(body_ops["CPU"], "all-gather")) == sorted([N * D * 4, N * k * 4, N * k * 4] * 4)
if "TPU7x" in per_group:
    ops = body_ops["TPU7x"]
    assert sorted(big_ones(ops, "all-gather")) == sorted([N * D * 2, N * k * 4, N * k * 2] * 4)
    summed = big_ones(ops, "reduce-scatter") + big_ones(ops, "all-reduce")
    assert summed in ([N // 8 * D * 2] * 4, [N * D * 2] * 4), summed  # reduce-scatter, or all-reduce + slice
print("predicted per MoE layer (bf16):",
      dict(x=N * D * 2, ids=N * k * 4, weights=N * k * 2, reduce_scatter=N // 8 * D * 2))

# %% [markdown]
# ## 4. Any number of requests
#
# The engine sends each new request to the least-loaded of the 8 data-parallel ranks; each rank has its own page
# and slot pools, on its own device. 1 request leaves 7 ranks idle (they run padding), 9 requests put 2 on
# one rank (one prefill chunk of 64 tokens per rank per step: its second request waits a step). **Predict:** the
# first generated token of each request is the argmax of the single-device logits at its last prompt position.

# %%
engine = Engine(dp_cfg, weights, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                mesh=mesh)
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

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(placement_397b=dict(weight_bytes=p.weight_bytes_per_device, kv_bytes=p.kv_bytes_per_device,
                                  gdn_state_bytes=p.gdn_state_bytes_per_device,
                                  total_bytes=p.total_bytes_per_device, fits=p.fits),
              logits_max_abs_err=float(err), collectives_per_group=per_group,
              first_tokens={str(k): v for k, v in first.items()})
notebook.save_results("dp_ep", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> Splitting requests for attention and experts for the MoE makes the mixers communication-free
# and leaves exactly 3 all-gathers and 1 reduce-scatter per layer, at the price of replicating the dense weights:
# 84 GiB per device for 512 requests of 8k tokens, which fits.
# </div>

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
# 2. **[Where the bytes go]** In section 3, which all-gather is the largest, and why is it so much larger than the
#    other two?
#    <details><summary>Answer</summary>
#
#    `body_ops["CPU"]` lists them with their shapes: the hidden states `[N, D]` carry `D` values per token, the
#    ids and weights `[N, k]` only `k` each.
#    </details>
#
# 3. **[Uneven ranks]** With 9 requests, one rank holds two. What does that cost the other 7 ranks in a step?
#    <details><summary>Answer</summary>
#
#    Every rank runs the same compiled step shape (`engine.stats.buckets`): the ranks with one request compute
#    padding for the second slot. Balanced admission (the least-loaded rank first) keeps that to one slot.
#    </details>
#
# 4. **[Routing all-to-all]** Rebuild `dp_cfg` with `routing="all_to_all"` and count the collectives of one
#    layer group again. What replaces the all-gathers and the reduce-scatter?
#    <details><summary>Answer</summary>
#
#    Two all-to-alls per MoE layer for the tokens (there and back) and one for the expert ids; notebook 03
#    compares the two strategies.
#    </details>
