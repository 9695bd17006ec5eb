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
# # 07 · Porting: the same blocks serve other Qwen MoE models
#
# Nothing in chapters 01-06 is specific to Qwen3.5-397B-A17B. The model is four blocks (gated GQA attention, Gated
# DeltaNet, a routed top-k MoE, a gated shared expert) and the serving plan is a record (`ServingPlan`) whose sizes
# come from the model and the mesh. This notebook takes three more checkpoints of the same family,
# Qwen3.5-122B-A10B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B, and asks what changes: not the code, but the plan's
# numbers (KV heads and experts per device, FP8 scale blocks per device, bytes per device), which layout each model
# can use on a TPU7x-8 and on a larger slice, what the cost model predicts, and whether a checkpoint of each shape
# loads and runs through the same code with the numbers transformers gives.

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/07_porting.ipynb)

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
# ## 1. What is the same, what changes
#
# **Compute.** The four configs side by side, and what they imply: parameters in all and per token, the KV cache
# per token of context (FP8), and how many FP8 scale blocks of `fp8_block_size` columns each expert's FFN holds.

# %%
from qwen35_lib.aot.sweep import serving_config
from qwen35_lib.stats import model_stats

MODELS = ("qwen3.5-397b-a17b", "qwen3.5-122b-a10b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b")
FP8_KV = "float8_e4m3fn"
# each model as it is served on TPU7x: FP8 experts, a bf16 GDN state (tpu-inference's choice)
served = {name: serving_config(name) for name in MODELS}

rows = {}
for name, c in served.items():
    s = model_stats(c, kv_dtype=FP8_KV)
    rows[name] = dict(model_type=c.model_type, layers=c.num_layers, hidden=c.hidden_size, q_heads=c.num_q_heads,
                      kv_heads=c.num_kv_heads, experts=c.num_experts, top_k=c.num_experts_per_tok,
                      expert_ffn=c.moe_ffn, ffn_fp8_blocks=c.moe_ffn // c.fp8_block_size,
                      total_params=s.total_params, active_params=s.active_params,
                      kv_bytes_per_token=s.kv_bytes_per_token)
cols = list(next(iter(rows.values())))
print(f"{'':<20}" + "".join(f"{k:>19}" for k in cols))
for name, r in rows.items():
    print(f"{name:<20}" + "".join(f"{r[k] / 1e9:>18.1f}B" if k.endswith("params") else f"{r[k]:>19}" for k in cols))

# %% [markdown]
# **Check.** The blocks are the same: every model repeats the pattern of three GDN layers and one attention layer,
# has 2 KV heads and a routed top-k MoE with one shared expert. What differs is sizes, and one of them matters more
# than it looks: the two small models' expert FFN holds fewer FP8 scale blocks than there are devices.

# %%
import qwen35_lib

assert {c.layer_pattern for c in served.values()} == {qwen35_lib.get_config("qwen3.5-397b-a17b").layer_pattern}
assert {c.num_kv_heads for c in served.values()} == {2}
few_blocks = [n for n, r in rows.items() if r["ffn_fp8_blocks"] < 8]
assert few_blocks == ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b"], few_blocks

# %% [markdown]
# ## 2. The plan on a TPU7x-8, and on a larger slice
#
# <details><summary><b>Pop quiz.</b> The baseline layout, `tp8_kvrep`, splits every expert's FFN columns 8 ways.
# Which of the four models can it serve with FP8 experts?</summary>
#
# Only those whose expert FFN holds a multiple of 8 scale blocks: a device's slice of an FP8 matrix must hold
# whole blocks, each with its one scale. The 35B and Qwen3-Next experts have fewer blocks along the FFN than there
# are devices (section 1 printed the counts), so 8-way tensor parallelism of their experts is refused (or needs
# bf16 experts, twice the bytes); expert parallelism keeps every expert whole on one device and has no such rule.
# </details>
#
# **Compute.** `placement` (the arithmetic over the same sharding rules the real arrays use) for each model under
# the baseline's `tp8_kvrep` and the ladder's `dp8_ep8`, at the serving shape of the sweep (512 requests, every
# request's whole context of the longer workload, FP8 KV pages of `PAGE` tokens): what a device holds and whether it
# fits its usable HBM. Then the same on 16 devices (8 chips), the next slice size, with `dp_ep`, the general name
# of `dp8_ep8`: the experts split 16 ways, the KV cache over 16 ranks.

# %%
from qwen35_lib.placement import placement
from qwen35_lib.report import human_bytes

CONTEXT, PAGE, REQUESTS = 8192 + 1024, 256, 512
PLACED = (("tp8_kvrep", 8), ("dp8_ep8", 8), ("dp_ep", 16))  # (layout, devices)
plans = {}
for name, c in served.items():
    for layout, n in PLACED:
        p = placement(c, layout, n, kv_dtype=FP8_KV, requests=REQUESTS, context_len=CONTEXT, page_size=PAGE)
        d = max(p.per_device, key=lambda d: d.total_bytes)
        plans[name, layout] = dict(
            devices=n, kv_heads_per_device=len(d.holds["kv_heads"]), experts_per_device=len(d.holds["experts"]),
            weight_bytes=d.weight_bytes, kv_bytes=d.kv_bytes, gdn_state_bytes=d.gdn_state_bytes,
            total_bytes=d.total_bytes, usable_bytes=p.usable_hbm_bytes_per_device, problem=p.problem,
            fits=p.problem is None and d.total_bytes <= p.usable_hbm_bytes_per_device)
for (name, layout), r in plans.items():
    verdict = f"refused: {r['problem']}" if r["problem"] else ("fits" if r["fits"] else "does not fit")
    print(f"{name:<20} {layout:<10} on {r['devices']:>2}: KV heads {r['kv_heads_per_device']}, experts "
          f"{r['experts_per_device']:>3}, weights {human_bytes(r['weight_bytes']):>10}, "
          f"KV {human_bytes(r['kv_bytes']):>9}, "
          f"GDN {human_bytes(r['gdn_state_bytes']):>9}, total {human_bytes(r['total_bytes']):>10} of "
          f"{human_bytes(r['usable_bytes'])}: {verdict}")

# %% [markdown]
# **Check.** Under `dp8_ep8` every model fits a TPU7x-8 at the full serving shape, and a device's experts are
# `E / 8` whole experts; `tp8_kvrep` gives each device a copy of one KV head (4 of them per KV head) and refuses
# the two models with too few FP8 blocks, with the fix in its message. On 16 devices each device holds half the
# experts it held on 8, and the per-device total falls.

# %%
from qwen35_lib import data

for name, c in served.items():
    ep = plans[name, "dp8_ep8"]
    assert ep["fits"] and ep["experts_per_device"] == c.num_experts // 8, (name, ep)
    assert ep["kv_heads_per_device"] == c.num_kv_heads  # data-parallel attention: whole KV heads per rank
    tp = plans[name, "tp8_kvrep"]
    assert (tp["problem"] is not None) == (name in few_blocks), (name, tp["problem"])
    assert tp["problem"] or tp["kv_heads_per_device"] == 1
    wide = plans[name, "dp_ep"]
    assert wide["experts_per_device"] == c.num_experts // 16 and wide["total_bytes"] < ep["total_bytes"]

# %% [markdown]
# ## 3. What the cost model predicts on a TPU7x-8
#
# **Compute.** `costmodel.predict` for each model at 512 concurrent requests, both workloads: the `kernels` stage
# (the end of the ladder) and the `baseline` (where the plan allows it). The cost model reads the same plans, so a
# layout the plan refuses is refused here too, with the same one-line reason.

# %%
import matplotlib.pyplot as plt
import numpy as np

from qwen35_lib.costmodel import predict

WORKLOADS = {"8k/1k": (8192, 1024), "1k/8k": (1024, 8192)}
predicted = {}
for name in MODELS:
    for stage in ("baseline", "kernels"):
        for wl, (isl, osl) in WORKLOADS.items():
            try:
                r = predict(name, "tpu7x-8", stage, isl, osl, 512, roofline=False)
            except ValueError as e:
                predicted[name, stage, wl] = dict(refused=str(e))
                continue
            predicted[name, stage, wl] = dict(total_tokens_per_s=r["total_tokens_per_s"],
                                              median_tpot_s=r["median_tpot_s"], fits=r["fits"])
for (name, stage, wl), r in predicted.items():
    print(f"{name:<20} {stage:<9} {wl}: " + (f"refused ({r['refused']})" if "refused" in r else
          f"{r['total_tokens_per_s']:>9,.0f} tokens/s, median TPOT {r['median_tpot_s'] * 1e3:5.1f} ms"))

# figure: throughput
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), sharey=True)
for ax, wl in zip(axes, WORKLOADS):
    x = np.arange(len(MODELS))
    for i, stage in enumerate(("baseline", "kernels")):
        v = [predicted[m, stage, wl].get("total_tokens_per_s", 0) for m in MODELS]
        ax.bar(x + (i - 0.5) * 0.38, v, 0.38, label=stage)
    ax.set_xticks(x, [m.removeprefix("qwen") for m in MODELS], rotation=15)
    ax.set_title(f"{wl}, TPU7x-8, 512 requests (predicted)")
axes[0].set_ylabel("total tokens/s")
axes[0].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# **Check.** Every model serves more tokens per second than the 397B model under the same stage (fewer active
# parameters per token, fewer bytes per step), and where the baseline runs, the ladder's end beats it for every
# model. The refused baselines are exactly the models of section 2.

# %%
for wl in WORKLOADS:
    big = predicted["qwen3.5-397b-a17b", "kernels", wl]["total_tokens_per_s"]
    for name in MODELS:
        k, b = predicted[name, "kernels", wl], predicted[name, "baseline", wl]
        assert k["fits"] and ("refused" in b) == (name in few_blocks), (name, wl, b)
        assert name == MODELS[0] or k["total_tokens_per_s"] > big, (name, wl)
        assert "refused" in b or k["total_tokens_per_s"] > b["total_tokens_per_s"], (name, wl)
tps = {(name, wl): predicted[name, "kernels", wl]["total_tokens_per_s"] for name in MODELS for wl in WORKLOADS}
others = [tps[name, wl] / tps[MODELS[0], wl] for name in MODELS[1:] for wl in WORKLOADS]
notebook.claim_greater("smaller_models_serve_more", "under the `kernels` stage every smaller model serves more tokens "
                       "per second than the 397B model, at least {least:.2f}x its throughput on either workload",
                       least=min(others), one=1.0)
beats = [predicted[name, "kernels", wl]["total_tokens_per_s"] / predicted[name, "baseline", wl]["total_tokens_per_s"]
         for name in MODELS for wl in WORKLOADS if "refused" not in predicted[name, "baseline", wl]]
notebook.claim_greater("kernels_beat_baseline", "where the baseline runs, the ladder's end beats it for every model "
                       "and workload, by {least:.1f}x at the least", least=min(beats), one=1.0)
refused = sorted({name for name in MODELS for wl in WORKLOADS if "refused" in predicted[name, "baseline", wl]})
notebook.claim("baseline_refused_few_blocks", "the TP baseline is refused for exactly the models whose experts hold "
               "fewer FP8 scale blocks along the FFN than there are devices ({names})", refused == sorted(few_blocks),
               "refused baselines == few_fp8_blocks", names=", ".join(refused))

# %% [markdown]
# ## 4. The same code: a checkpoint of each shape
#
# **Measure.** For the two checkpoint formats of the family, Qwen3.5 (the 397B model's shape) and Qwen3-Next (which
# stores its GDN projections differently), a transformers checkpoint of a small twin: the same `model_type`, 2 KV
# heads, the same top-k, the same ratio of GDN value to key heads, and a sixteenth of the experts (a multiple of 8).
# Each is written to disk, loaded by `load_hf_checkpoint` straight into `dp8_ep8` shards on the 8 devices, and
# run; its float32 logits are compared with transformers' on the same tokens. (The 122B and 35B twins are the
# Qwen3.5 format at other counts: `twin_overrides` makes them too, exercise 3.)

# %%
import pathlib
import tempfile

import jax
import torch  # noqa: E402  (the transformers reference, from here on)

from qwen35_lib.checkpoint import load_hf_checkpoint
from qwen35_lib.plan import get_layout, make_mesh
from qwen35_lib.testing import make_hf_model, save_hf_checkpoint  # noqa: E402


def twin_overrides(c) -> dict:
    """transformers config fields of a small twin of `c` (see the markdown above)."""
    return dict(num_attention_heads=c.num_q_heads // 4, num_key_value_heads=c.num_kv_heads,
                linear_num_key_heads=c.gdn_num_k_heads // 8, linear_num_value_heads=c.gdn_num_v_heads // 8,
                num_experts=c.num_experts // 16, num_experts_per_tok=c.num_experts_per_tok)


mesh = make_mesh()
tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
twins = {}
with tempfile.TemporaryDirectory() as tmp:
    for name in ("qwen3.5-397b-a17b", "qwen3-next-80b-a3b"):
        c = served[name]
        hf = make_hf_model(c.model_type, seed=0, **twin_overrides(c))
        path = save_hf_checkpoint(hf, pathlib.Path(tmp, name))
        cfg, weights = load_hf_checkpoint(path, layout="dp8_ep8", mesh=mesh, progress=False)
        with jax.set_mesh(mesh):
            ours = np.asarray(qwen35_lib.forward(cfg, weights, tokens, plan=get_layout("dp8_ep8")))
        with torch.no_grad():
            ref = hf(torch.as_tensor(tokens)).logits.float().numpy()
        twins[name] = dict(model_type=cfg.model_type, experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                           max_abs_logit_diff=float(np.abs(ours - ref).max()),
                           greedy_equal=bool((ours.argmax(-1) == ref.argmax(-1)).all()))
        print(f"{name:<20} twin ({cfg.model_type}, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}) under "
              f"dp8_ep8: max |Δ logits| {twins[name]['max_abs_logit_diff']:.1e}, greedy tokens equal: "
              f"{twins[name]['greedy_equal']}")

# %% [markdown]
# **Check.** Both twins, Qwen3-Next's storage included, give transformers' logits to float32 rounding under the
# 8-device layout: no model-specific code was needed.

# %%
for name, t in twins.items():
    assert t["max_abs_logit_diff"] <= 1e-4 and t["greedy_equal"], (name, t)
assert twins["qwen3-next-80b-a3b"]["model_type"] == "qwen3_next"

# %% [markdown]
# ## 5. Compiled for TPU7x
#
# **Measure.** What the TPU compiler says about each model's decode step at the serving shape under the `kernels`
# stage: sweep entries of two layer groups at full width (`python -m qwen35_lib.aot sweep --model NAME --stages
# kernels --steps "8k/1k decode" --groups 2 --no-largest-pool --json data/aot/port/NAME.json`), stored in
# `data/aot/port/`. Set `QWEN35_AOT_PORT=1` to
# recompile them here (a few minutes each on a CPU; needs the 'tpu' extra). Beside each: `placement`'s arithmetic
# for the same two-group model, which must equal the compiled arguments (weights and caches).

# %%
import importlib.util
import json
import os

LIVE = os.environ.get("QWEN35_AOT_PORT") == "1" and importlib.util.find_spec("libtpu") is not None
compiled = {}
for name in MODELS:
    file = f"aot/port/{name}.json"
    if LIVE:
        from qwen35_lib.aot.sweep import sweep

        doc = sweep(name, stages=["kernels"], groups=2, steps=("8k/1k decode",), largest=False, progress=False)
    elif data.path(file).exists():
        doc = json.loads(data.path(file).read_text())
    else:
        print(f"{name}: no stored entry ({file}); run the sweep command above")
        continue
    e = doc["stages"]["kernels"]["steps"]["8k/1k decode"]
    two = serving_config(name, groups=2)
    p = placement(two, "dp8_ep8", 8, kv_dtype=FP8_KV, requests=REQUESTS, context_len=CONTEXT, page_size=PAGE)
    d = max(p.per_device, key=lambda d: d.total_bytes)
    compiled[name] = dict(argument_bytes=e["argument_bytes"], temp_bytes=e["temp_bytes"],
                          total_bytes=e["total_bytes"], fits=e["fits"], compile_s=e["compile_s"],
                          placement_bytes=d.total_bytes, argument_over_placement=e["argument_bytes"] / d.total_bytes)
    print(f"{name:<20} 2 groups: arguments {human_bytes(e['argument_bytes'])} (placement "
          f"{human_bytes(d.total_bytes)}), temporaries {human_bytes(e['temp_bytes'])}, total "
          f"{human_bytes(e['total_bytes'])}, fits: {e['fits']} ({e['compile_s']:.0f} s to compile)")

# %% [markdown]
# **Check.** Every stored step compiles and fits, and the compiler's argument bytes agree with the placement
# arithmetic to within a percent (the rest is the step's small inputs: token ids, positions, page tables).

# %%
for name, r in compiled.items():
    assert r["fits"], (name, r)
    assert 1 <= r["argument_over_placement"] < 1.01, (name, r)

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(
    models={name: r for name, r in rows.items()},
    plans={name: {layout: plans[name, layout] for layout, _ in PLACED} for name in MODELS},
    few_fp8_blocks=few_blocks,
    predicted={name: {stage: {wl: predicted[name, stage, wl] for wl in WORKLOADS} for stage in ("baseline", "kernels")}
               for name in MODELS},
    kernels_over_baseline={name: {wl: predicted[name, "kernels", wl]["total_tokens_per_s"] /
                                  predicted[name, "baseline", wl]["total_tokens_per_s"]
                                  for wl in WORKLOADS if "refused" not in predicted[name, "baseline", wl]}
                           for name in MODELS},
    twins=twins, compiled=compiled)
notebook.save_results("porting", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> Porting is a change of numbers, not of code: the same blocks load each checkpoint and give
# transformers' logits, and the same plan record places each model. What the plan's numbers say differs by model:
# a model whose expert FFN holds fewer FP8 scale blocks than there are devices cannot use tensor-parallel experts
# at all, so expert parallelism is not only faster for it but the only layout with FP8 experts; and a larger
# slice buys every model room by splitting its experts further.
# </div>
#
# ## What we learned
#
# - The serving plan's sizes come from the model and the mesh (`ServingPlan`, `placement`): KV heads per device,
#   experts per device and FP8 blocks per device are read, never assumed.
# - The layout each model can use is decided by divisibility before speed: FP8 scale blocks along the expert FFN
#   rule out 8-way tensor-parallel experts for the 35B and Qwen3-Next models.
# - The cost model and the ahead-of-time compile read the same plans, so their answers for a new model come with
#   the same evidence as for the 397B one.
#
# ## Exercises
#
# 1. **[Qwen3.5-35B on 4 devices]** Which layouts does `placement(serving_config("qwen3.5-35b-a3b"), layout, 4)`
#    accept, and how many requests of the 8k/1k workload fit per device under each?
#    <details><summary>Answer</summary>
#
#    `dp_ep` and `dp_tp2_ep` keep experts whole and are accepted; `tp_kvrep` splits the expert FFN 4 ways, which
#    its FP8 blocks allow (as many as the devices: `ffn_fp8_blocks` of section 1). Compare `total_bytes` at a few
#    request counts: the KV cache grows linearly with them.
#    </details>
#
# 2. **[bf16 experts]** Give the 35B model bf16 experts (`expert_dtype=None`) and run section 2 again: does
#    `tp8_kvrep` accept it, and what does it cost in weight bytes per device?
#    <details><summary>Answer</summary>
#
#    It is accepted (no scale blocks to keep whole), and the experts take twice their FP8 bytes on every device.
#    </details>
#
# 3. **[The other twins]** Run section 4 for `qwen3.5-122b-a10b` and `qwen3.5-35b-a3b` too.
#    <details><summary>Answer</summary>
#
#    The same loop over all of `served`: both load into `dp8_ep8` shards and match transformers to float32
#    rounding, like the 397B twin (the same format, other head and expert counts).
#    </details>

# %% [markdown]
# **The answers, computed.** Each exercise's numbers, from this run, folded until you open them (exercise 3's: the
# twins the loop of section 4 would build for the other models, and whether `dp8_ep8` takes them; running it is the
# check, about half a minute a model on a CPU).

# %%
small = serving_config("qwen3.5-35b-a3b")


def most_requests(c, layout, n, top=4096):  # the largest request count of 9,216 tokens whose placement fits
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = placement(c, layout, n, kv_dtype=FP8_KV, requests=mid, context_len=CONTEXT, page_size=PAGE).fits
        lo, hi = (mid, hi) if ok else (lo, mid - 1)
    return lo


four = {layout: placement(small, layout, 4, kv_dtype=FP8_KV, requests=REQUESTS, context_len=CONTEXT, page_size=PAGE)
        for layout in ("tp_kvrep", "dp_tp2_ep", "dp_ep")}
notebook.answer(1, "on 4 devices: " + "; ".join(f"{layout} accepted {p.problem is None}, at most "
                                                 f"{most_requests(small, layout, 4) if p.problem is None else 0:,} "
                                                 "requests of {ctx:,} tokens" for layout, p in four.items()),
                ctx=CONTEXT)
bf16_small = small.replace(expert_dtype=None)
tp = {name: placement(c, "tp8_kvrep", 8, kv_dtype=FP8_KV, requests=REQUESTS, context_len=CONTEXT, page_size=PAGE)
      for name, c in (("bf16", bf16_small), ("fp8", small))}
notebook.answer(2, "bf16 experts under tp8_kvrep: accepted {ok}; {w:.2f} GiB of weights a device, against {w8:.2f} GiB "
                "with FP8 experts (where it is refused: {refused}).", ok=tp["bf16"].problem is None,
                w=tp["bf16"].weight_bytes_per_device / 2**30, w8=tp["fp8"].weight_bytes_per_device / 2**30,
                refused=tp["fp8"].problem is not None)
others = {name: twin_overrides(served[name]) for name in ("qwen3.5-122b-a10b", "qwen3.5-35b-a3b")}
notebook.answer(3, "; ".join(f"{name}: a twin of {o['num_attention_heads']} query and {o['num_key_value_heads']} KV "
                             f"heads, {o['linear_num_key_heads']} / {o['linear_num_value_heads']} GDN key / value "
                             f"heads, {o['num_experts']} experts top-{o['num_experts_per_tok']}, whose experts "
                             f"{'split' if o['num_experts'] % 8 == 0 else 'do not split'} over dp8_ep8's 8 devices"
                             for name, o in others.items()))
