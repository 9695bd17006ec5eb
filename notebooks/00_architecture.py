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
# # 00 · Architecture: what is in Qwen3.5-397B-A17B, and what must fit in 8 x 96 GiB?
#
# Qwen3.5-397B-A17B holds about 397 billion parameters but runs about 17 billion of them per token. Its layers
# mix Gated DeltaNet (linear attention, a fixed-size state per request) with gated attention that has only 2 KV
# heads, and every layer ends in a mixture of 512 experts. Before sharding anything, this notebook asks: where
# do the parameters sit, what does one request cost in cache, and does the model fit on a TPU7x-8 (4 Ironwood
# chips, 8 TensorCores, 8 x 96 GiB of HBM) with room left for 512 concurrent requests?

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/00_architecture.ipynb)

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
# ## 1. Anatomy
#
# ```
# token ids -> embed [V, D]
#   repeat for each layer:   h = h + mixer(norm(h))     mixer: Gated DeltaNet, or gated GQA attention
#                            h = h + MoE(norm(h))       MoE:   top-k of E routed experts + 1 shared expert
# -> norm -> lm_head [D, V] -> logits
# ```
#
# The mixers repeat in a fixed pattern: three Gated DeltaNet (GDN) layers, then one attention layer. GDN keeps
# a fixed-size recurrent state per request, whatever the context length; attention keeps K and V for every
# token, but with only 2 KV heads. The sizes, from the preset:

# %%
import qwen35_lib
from qwen35_lib import viz

cfg = qwen35_lib.get_config("qwen3.5-397b-a17b")

c = cfg
print(f"hidden D = {c.hidden_size}, vocab V = {c.vocab_size:,}, {c.num_layers} layers = {c.num_groups} groups of "
      f"{c.layer_pattern}")
print(f"attention: {c.num_q_heads} query heads, {c.num_kv_heads} KV heads of {c.head_dim} "
      f"({c.rotary_dim} rotary dims), sigmoid output gate")
print(f"Gated DeltaNet: {c.gdn_num_k_heads} key heads of {c.gdn_k_head_dim}, {c.gdn_num_v_heads} value heads of "
      f"{c.gdn_v_head_dim}, conv kernel {c.gdn_conv_kernel}")
print(f"MoE: {c.num_experts} experts of FFN {c.moe_ffn}, top-{c.num_experts_per_tok}, "
      f"+ a shared expert of FFN {c.shared_ffn}")
viz.plot_layer_pattern(cfg)

# %% [markdown]
# **The mesh the chapters place work on.** `notebook.setup` built it: the devices as `('chip', 'core')`, the two
# TensorCores of each chip along `core` and the chips along `chip`, which on a TPU7x-8 are joined in a ring of
# ICI links (each chip has two neighbours). On this machine the devices are simulated CPU devices with the same
# ids and axes; the figure is the primer's.

# %%
# figure: mesh
from qwen35_lib.viz.teaching import plot_mesh

print(dict(mesh.shape))
plot_mesh([[d.id for d in chip] for chip in mesh.devices])

# %% [markdown]
# ## 2. Parameters: total and active
#
# <details><summary><b>Pop quiz.</b> The name says about 397 billion parameters in all and about 17 billion active
# per token. Which part holds most of the total, and is it also most of what a token runs?</summary>
#
# The routed experts hold most of the total: 512 experts in each of 60 layers, three `D x F` matrices each. A token
# runs 10 of the 512, about a fiftieth of them, so their share of the active count is far smaller, under half of
# it; attention, GDN, the shared experts and the embeddings are small beside the experts, but every token reads
# them. The report below splits both counts by part.
# </details>
#
# **Predict.** A routed expert is a SwiGLU MLP, three `D x F` matrices, so the routed experts hold
# `L * E * 3 * D * F` parameters. A token runs `k` of the `E` experts, so it touches
# `active = total - routed * (1 - k / E)`. The routed experts should dominate the total, and not the active count.

# %%
D, F, E, k, L = c.hidden_size, c.moe_ffn, c.num_experts, c.num_experts_per_tok, c.num_layers
predicted_routed = L * E * 3 * D * F
print(f"predicted routed-expert parameters: {predicted_routed:,}; per token: {predicted_routed * k // E:,}")

# %% [markdown]
# **Compute.** `qwen35_lib.model_stats` counts over the weight declarations (`qwen35_lib.weights.declare`): the
# same tree that random init, checkpoint loading and sharding use. `python -m qwen35_lib info --model
# qwen3.5-397b-a17b` prints the same report.

# %%
from qwen35_lib.report import format_report, model_report

stats = qwen35_lib.model_stats(cfg)
print(format_report(model_report(cfg)))

# %%
viz.plot_param_breakdown(cfg)

# %% [markdown]
# **Check.** The declarations agree with the prediction, and with HF transformers' own module built on the
# `meta` device (no memory) when transformers is installed.

# %%
import importlib.util

assert stats.params_by_part["routed_experts"] == predicted_routed
assert stats.active_params == stats.total_params - predicted_routed + predicted_routed * k // E
HAVE_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch") is not None
if HAVE_HF:
    import torch
    import transformers

    from qwen35_lib import testing

    transformers.logging.set_verbosity_error()  # quiet: no progress bars, no notes on missing fast kernels
    transformers.logging.disable_progress_bar()
    hf_config = testing.tiny_hf_config(  # transformers' names for our Config's fields
        "qwen3_5_moe", vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_q_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        linear_num_key_heads=c.gdn_num_k_heads, linear_num_value_heads=c.gdn_num_v_heads,
        linear_key_head_dim=c.gdn_k_head_dim, linear_value_head_dim=c.gdn_v_head_dim, num_experts=E,
        num_experts_per_tok=k, moe_intermediate_size=F, shared_expert_intermediate_size=c.shared_ffn)
    with torch.device("meta"):  # shapes only, no memory
        hf_total = sum(p.numel() for p in transformers.Qwen3_5MoeForCausalLM(hf_config).parameters())
    assert hf_total == stats.total_params, (hf_total, stats.total_params)
    print(f"transformers' Qwen3_5MoeForCausalLM has {hf_total:,} parameters: the same")
else:
    print("transformers not installed: skipped the comparison with HF")

# %% [markdown]
# ## 3. Caches: per token and per request
#
# <details><summary><b>Pop quiz.</b> A request with 1k tokens of context: which is larger, its KV cache or its GDN
# state?</summary>
#
# The GDN state. Attention has only 2 KV heads of 256 values, in 15 of the 60 layers, so a token adds little KV
# cache; each of the 45 GDN layers keeps a state of 64 value heads of `128 x 128` values per request, however
# short the context. The second cell below prints how many tokens of KV cache one request's GDN state is worth:
# more than 1k.
# </details>
#
# **Predict.** Each attention layer caches K and V for every token: `2 * KV heads * head_dim` values. Each GDN
# layer keeps one state of `value heads * key dim * value dim` values per request, plus the last `K - 1` inputs
# of its causal convolution, however long the context. HF keeps the GDN state in float32; tpu-inference keeps
# it in bf16, as we will when serving.

# %%
serve = cfg.replace(gdn_state_dtype="bfloat16")
n_attn, n_gdn = cfg.layer_types.count("full_attention"), cfg.layer_types.count("linear_attention")
predicted_kv = 2 * n_attn * c.num_kv_heads * c.head_dim * 2  # bytes per token, bf16
predicted_gdn = n_gdn * (c.gdn_num_v_heads * c.gdn_k_head_dim * c.gdn_v_head_dim
                         + c.gdn_conv_dim * (c.gdn_conv_kernel - 1)) * 2  # bytes per request, bf16
print(f"predicted: KV {predicted_kv:,} B per token; GDN state {predicted_gdn:,} B per request")

# %% [markdown]
# **Compute** (the same counts over the declarations) and **check**.

# %%
from qwen35_lib.report import human_bytes

serve_stats = qwen35_lib.model_stats(serve)
assert serve_stats.kv_bytes_per_token == predicted_kv
assert serve_stats.gdn_state_bytes_per_seq == predicted_gdn
CONTEXT = 8192 + 1024  # a request's whole context in either workload (8k/1k or 1k/8k): input plus output
print(f"KV cache: {human_bytes(serve_stats.kv_bytes_per_token)} per token, "
      f"{human_bytes(CONTEXT * serve_stats.kv_bytes_per_token)} for a request's whole context ({CONTEXT:,} tokens)")
print(f"GDN state: {human_bytes(serve_stats.gdn_state_bytes_per_seq)} per request "
      f"({human_bytes(stats.gdn_state_bytes_per_seq)} with HF's float32 state), "
      f"as much as {serve_stats.gdn_state_bytes_per_seq // serve_stats.kv_bytes_per_token:,} tokens of KV cache")

# %% [markdown]
# ## 4. The HBM budget of a TPU7x-8
#
# <details><summary><b>Pop quiz.</b> At two bytes per parameter, do the bf16 weights fit in 8 x 96 GiB of HBM, and
# is there room left for the caches of 512 concurrent requests?</summary>
#
# The weights squeeze in, but they take nearly all of it: what is left is less than the GDN state of 512 requests
# alone (section 3's state per request, times 512), before any KV cache. FP8 routed experts store one byte per
# parameter, nearly halving the weights, and then both workloads fit. The second cell below prints each verdict
# with its bytes.
# </details>
#
# **Predict.** bf16 weights take 2 bytes per parameter. FP8 (e4m3, block-scaled) routed experts take 1 byte
# per parameter plus one float32 scale per 128 x 128 block; the rest stays bf16.

# %%
from qwen35_lib import hardware

tpu = hardware.get("tpu7x-8")
routed = stats.params_by_part["routed_experts"]
predicted_bf16 = 2 * stats.total_params
predicted_fp8 = 2 * (stats.total_params - routed) + routed
print(f"{tpu.name}: {tpu.chips} chips x {tpu.devices_per_chip} TensorCores, {human_bytes(tpu.hbm_bytes_per_device)} "
      f"per device, {human_bytes(tpu.hbm_bytes)} in all")
print(f"predicted weights: bf16 {human_bytes(predicted_bf16)}, FP8 experts {human_bytes(predicted_fp8)} (+ scales)")

# %% [markdown]
# **Compute.** `qwen35_lib.budget.hbm_budget` puts the weights on the devices and asks what the caches of 512
# concurrent requests need, at a request's whole context (9,216 tokens: 8k in and 1k out, or 1k in and 8k out) and
# at 1k tokens of context each. The `even` spread splits every weight
# over the 8 devices: the best any layout can do.

# %%
from qwen35_lib import budget

# figure: hbm_budget
bf16, fp8 = serve, serve.replace(expert_dtype="float8_e4m3fn")
budgets = [budget.hbm_budget(m, tpu, concurrency=512, context_len=n) for m in (bf16, fp8) for n in (CONTEXT, 1024)]
for b in budgets:
    verdict = f"fits, {human_bytes(b.left_bytes)} left" if b.fits else f"short by {human_bytes(-b.left_bytes)}"
    print(f"{b.weight_dtypes:<32} {b.context_len:>5} tokens: weights {human_bytes(b.weight_bytes)}, free "
          f"{human_bytes(b.free_bytes)}, KV {human_bytes(b.kv_cache_bytes)} + GDN {human_bytes(b.gdn_state_bytes)}: "
          f"{verdict}")
viz.plot_hbm_budget(budgets)

# %% [markdown]
# <details><summary><b>Pop quiz.</b> Of the four compiles below (bf16 or FP8 experts, placed `even` or
# `experts_sharded`), which will XLA refuse?</summary>
#
# bf16 under `experts_sharded`. Placed `even`, the bf16 weights already fill most of a device's HBM; replicating
# every weight that is not a routed expert adds seven more copies of the dense weights to the slice, and a
# device's share no longer fits. With FP8 experts both spreads fit. The printout gives XLA's bytes per device, or
# its refusal.
# </details>
#
# **Measure it as a TPU would.** With libtpu installed, XLA compiles for a TPU7x-8 (`tpu7x:2x2x1`) on this
# machine, nothing allocated. We compile a program that takes all the weights, placed `even`, or
# `experts_sharded`: routed experts split 8 ways and every other weight replicated on each device, which is
# what data-parallel attention with expert parallelism (notebook 02) does. XLA reports the bytes per device,
# or refuses.

# %%
import jax

from qwen35_lib.costmodel import temporaries

compiled = {}
if importlib.util.find_spec("libtpu") is not None:  # the 'tpu' extra
    for m in (bf16, fp8):
        for spread in budget.WEIGHT_SPREADS:
            compiled[m.expert_dtype or m.dtype, spread] = (m, budget.compiled_weight_bytes(m, spread))
else:
    print("libtpu not installed (pip install 'jax[tpu]'): skipped the ahead-of-time compiles")
for (dtype, spread), (m, r) in compiled.items():
    predicted = budget.weight_bytes_per_device(m, tpu.devices, spread)
    got = human_bytes(r.argument_bytes_per_device) if r.error is None else r.error
    print(f"{dtype:<14} {spread:<16} predicted {human_bytes(predicted)} per device; XLA: {got}")
    if r.error is not None:  # the refusal's "HLO temporaries" figure, read as bytes
        print(f"{'':<31} the refusal's figure: {human_bytes(temporaries.refused_bytes(r.error))}, the weights' "
              f"{human_bytes(predicted)}")

# %% [markdown]
# **Check.** bf16 weights squeeze in, but the GDN state of 512 requests alone is more than what is left, even
# at 1k tokens; with FP8 experts both workloads fit. XLA's per-device bytes match the prediction, and it refuses
# bf16 weights once the dense weights are replicated. Its message names a figure it calls "HLO temporaries",
# and that figure equals the weights: a program that holds nothing but its arguments is refused with its arguments'
# bytes. The compiler's figure is the program's whole footprint, arguments included; notebook 01 reads a refused
# step that way. The message also names the HBM a program may use per device, a little under the table's 96 GiB.

# %%
bf16_full, bf16_1k, fp8_full, fp8_1k = budgets
assert bf16_1k.weights_fit and not bf16_1k.fits
GiB = 2**30
notebook.claim_greater("gdn_exceeds_bf16_room", "with bf16 weights the slice has {free:.1f} GiB left for caches, "
                       "less than the {gdn:.1f} GiB of GDN state 512 requests need alone",
                       gdn=bf16_1k.gdn_state_bytes / GiB, free=bf16_1k.free_bytes / GiB)
notebook.claim("fp8_fits", "with FP8 experts the slice has {free:.1f} GiB left, room for both caches of 512 requests "
               "of {context:,} tokens ({caches:.1f} GiB)", fp8_full.fits and fp8_1k.fits, "fp8 fits, both contexts",
               free=fp8_full.free_bytes / GiB, caches=fp8_full.cache_bytes / GiB, context=fp8_full.context_len)
routed_share = stats.params_by_part["routed_experts"] / stats.total_params
active_routed_share = predicted_routed * k // E / stats.active_params
notebook.claim_greater("experts_most_bytes", "the routed experts are {share:.0%} of the parameters but "
                       "{active:.0%} of those a token uses", share=routed_share, active=active_routed_share)
for (dtype, spread), (m, r) in compiled.items():
    predicted = budget.weight_bytes_per_device(m, tpu.devices, spread)
    if r.error is None:
        assert abs(r.argument_bytes_per_device - predicted) <= 1e-3 * predicted, (dtype, spread, r)
    else:
        assert "RESOURCE_EXHAUSTED" in r.error and predicted > tpu.hbm_bytes_per_device, r
        assert abs(temporaries.refused_bytes(r.error) - predicted) <= 0.01 * predicted, r  # the whole footprint
print(f"bf16: at most {bf16_1k.max_concurrency} requests of 1k tokens; FP8 experts: at most "
      f"{fp8_full.max_concurrency:,} of {CONTEXT:,}, {fp8_1k.max_concurrency:,} of 1k")

# %% [markdown]
# ## 5. The same model, small: our logits against transformers
#
# Everything above came from declarations. To see that they describe the model HF runs, build a tiny random
# Qwen3.5 MoE in transformers, save it as a checkpoint (one tensor per expert, as the released checkpoints
# are), load it with `qwen35_lib.load_hf_checkpoint`, and compare logits.

# %%
import tempfile

import numpy as np

if HAVE_HF:
    hf_model = testing.make_hf_model(model_type="qwen3_5_moe", seed=0)
    with tempfile.TemporaryDirectory() as checkpoint:
        testing.save_hf_checkpoint(hf_model, checkpoint, form="per_expert")
        tiny, tiny_weights = qwen35_lib.load_hf_checkpoint(checkpoint)
    ids = np.random.default_rng(0).integers(0, tiny.vocab_size, size=(2, 16))
    with jax.default_matmul_precision("highest"):  # float32 matmuls in full precision on a TPU too
        ours = np.asarray(qwen35_lib.forward(tiny, tiny_weights, ids))
    with torch.no_grad():
        theirs = hf_model(torch.as_tensor(ids)).logits.float().numpy()
    print(f"{tiny.name}: {qwen35_lib.model_stats(tiny).total_params:,} parameters; logits {ours.shape}, "
          f"max |ours - transformers| = {np.abs(ours - theirs).max():.2e}")
else:
    print("transformers not installed: skipped the comparison with HF")

# %% [markdown]
# **Check.** Same parameter count, same logits (float32, up to summation order).

# %%
if HAVE_HF:
    assert qwen35_lib.model_stats(tiny).total_params == sum(p.numel() for p in hf_model.parameters())
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-3)

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(total_params=stats.total_params, active_params=stats.active_params,
              kv_bytes_per_token=serve_stats.kv_bytes_per_token,
              gdn_state_bytes_per_seq=serve_stats.gdn_state_bytes_per_seq,
              budgets=[b.as_dict() for b in budgets])
notebook.save_results("architecture", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> The routed experts are nearly all of the weights but under half of the per-token work, so
# storing them in FP8 is what leaves a TPU7x-8 room for the GDN state and KV cache of 512 concurrent requests.
# </div>
#
# ## What we learned
#
# - A mixture of experts is large in storage and small in work: the routed experts are nearly all of the
#   parameters, while every token reads the dense part, so memory and compute have to be planned separately.
# - A hybrid model's cache has two parts that scale differently: GDN state per request, fixed, and KV cache per
#   token, growing. With only 2 KV heads a request's KV cache outgrows its state only at long contexts (section 3
#   prints where), so a short request is not cheap: it pays for the whole state.
# - Fitting the weights is not fitting the server: bf16 weights fit the slice and leave no room for 512 requests'
#   caches. FP8 experts are part of the serving configuration, not an optimisation.
# - Replication has a price in HBM: a layout that copies the dense weights to every device needs the room FP8
#   makes, and XLA's compile for TPU7x says so before any hardware does.
# - One declaration of the weights drives the counts, the placement, XLA's bytes and a loaded checkpoint, so every
#   figure above is checked against an independent count (transformers', the compiler's), not assumed.

# %% [markdown]
# ## Exercises
#
# 1. **[GDN vs KV]** A request with a long context: at what length does its KV cache outgrow its GDN state?
#    <details><summary>Answer</summary>
#
#    When `context_len * kv_bytes_per_token > gdn_state_bytes_per_seq`: compute
#    `serve_stats.gdn_state_bytes_per_seq // serve_stats.kv_bytes_per_token` (printed in section 3). Below that
#    length the 45 GDN layers cost more than the 15 attention layers, although attention is the part that grows.
#    </details>
#
# 2. **[Replication]** Data-parallel attention replicates every weight that is not a routed expert on each of
#    the 8 devices. How many extra bytes does that cost the slice with FP8 experts, and what is left for caches?
#    <details><summary>Answer</summary>
#
#    `budget.hbm_budget(fp8, tpu, 512, 9216, spread="experts_sharded")`: `weight_bytes_on_devices -
#    weight_bytes` is 7 extra copies of the dense weights (attention, GDN, shared experts, router, embeddings),
#    and `free_bytes` shrinks by as much; `.fits` tells whether 512 requests of 9,216 tokens still fit. With bf16
#    weights the same spread does not even fit the weights: XLA refused it above.
#    </details>
#
# 3. **[State dtype]** Keep HF's float32 GDN state instead of bf16. How many requests of 9,216 tokens fit with FP8
#    experts?
#    <details><summary>Answer</summary>
#
#    `budget.hbm_budget(fp8.replace(gdn_state_dtype="float32"), tpu, 512, 9216).max_concurrency`: the state
#    doubles, so fewer requests fit, but more than 512 still do.
#    </details>
#
# 4. **[Other hardware]** Does the model fit on eight H200s? On a v5p-8? Use the command line.
#    <details><summary>Answer</summary>
#
#    `python -m qwen35_lib info --model qwen3.5-397b-a17b --hardware h200-8 --expert-dtype float8_e4m3fn
#    --gdn-state-dtype bfloat16 --concurrency 512 --context-len 9216`, then `--hardware v5p-8` (4 chips: the FP8
#    weights alone nearly fill their HBM).
#    </details>
#
# 5. **[Workload lengths]** The budgets above hold each request's whole context, input plus output. How many
#    more requests would fit if only the 8k input were cached, for FP8 experts?
#    <details><summary>Answer</summary>
#
#    Compare `budget.hbm_budget(fp8, tpu, 512, 8192).max_concurrency` with the whole context's: more fit, though
#    fewer than a ninth more: the KV cache shrinks by a ninth, the GDN state not at all.
#    </details>

# %% [markdown]
# **The answers, computed.** Each exercise's numbers, from this run, folded until you open them.

# %%
n = serve_stats.gdn_state_bytes_per_seq // serve_stats.kv_bytes_per_token
notebook.answer(1, "At {n:,} tokens: a request's GDN state ({gdn:.1f} MiB) equals that many tokens of KV cache "
                "({kv:,} bytes a token); below it the GDN layers cost more.", n=n,
                gdn=serve_stats.gdn_state_bytes_per_seq / 2**20, kv=serve_stats.kv_bytes_per_token)
rep = budget.hbm_budget(fp8, tpu, 512, CONTEXT, spread="experts_sharded")
notebook.answer(2, "{extra:.1f} GiB of extra copies over the slice; {free:.1f} GiB left for caches; 512 requests of "
                "{ctx:,} tokens fit: {fits}.", extra=(rep.weight_bytes_on_devices - rep.weight_bytes) / GiB,
                free=rep.free_bytes / GiB, ctx=CONTEXT, fits=rep.fits)
notebook.answer(3, "{n:,} requests of {ctx:,} tokens with a float32 GDN state (against {was:,} with bf16).",
                n=budget.hbm_budget(fp8.replace(gdn_state_dtype="float32"), tpu, 512, CONTEXT).max_concurrency,
                ctx=CONTEXT, was=fp8_full.max_concurrency)
other = {name: budget.hbm_budget(fp8, hardware.get(name), 512, CONTEXT) for name in ("h200-8", "v5p-8")}
notebook.answer(4, "h200-8: fits {h}, at most {hn:,} requests of {ctx:,} tokens; v5p-8: fits {v}, at most {vn:,}.",
                h=other["h200-8"].fits, hn=other["h200-8"].max_concurrency, v=other["v5p-8"].fits,
                vn=other["v5p-8"].max_concurrency, ctx=CONTEXT)
notebook.answer(5, "{n:,} requests with only the 8k input cached, against {was:,} with the whole context: {more:.1%} "
                "more.", n=budget.hbm_budget(fp8, tpu, 512, 8192).max_concurrency, was=fp8_full.max_concurrency,
                more=budget.hbm_budget(fp8, tpu, 512, 8192).max_concurrency / fp8_full.max_concurrency - 1)
