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
# # 09 · Multi-token prediction: the model drafts, the engine verifies
#
# Qwen3.5 checkpoints ship a multi-token-prediction (MTP) head: one more decoder layer that reads the last hidden state
# and the next token and guesses the token after it. Drafting k tokens with the head and checking them in the next step
# (the drafts and the token before them, one pass through the full model) turns one step into as many output tokens as
# the drafts it confirms, plus one, and a greedy verifier keeps exactly the tokens the model would have produced alone.
# This notebook asks what that buys on a decode step whose time is bytes: predict it with the roofline at every
# concurrency, measure it on this machine's engine with a head distilled here, then predict it for TPU7x-8 and check the
# prediction's memory against the compiled verify step.

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/qwen35-playbook/qwen35-playbook/blob/main/notebooks/09_multi_token_prediction.ipynb)

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
# ## 1. Predict: the bytes a verify step moves per generated token
#
# <details><summary><b>Pop quiz.</b> A decode step at 512 concurrent requests already reads nearly every expert.
# Verifying 3 drafts a sequence puts each sequence's drafts and the token before them through the model: does the
# step's memory traffic grow with the tokens, barely, or somewhere between, and what decides it?</summary>
#
# Somewhere between. What a step reads once whatever its tokens (the dense weights, and the experts once every
# expert is touched) does not grow; what each token owns grows with the tokens: the GDN recurrent state each
# verified token's checkpoint writes, the rows the MoE permutes, the logits. And the drafts themselves cost a pass of
# the head per draft, each reading the LM head. The roofline below sums these component by component.
# </details>
#
# **Compute.** The cost model's bytes per device for one decode step of the `kernels` stage on TPU7x-8
# (`costmodel.step.step_costs`, component by component), with and without 3 drafts a sequence, at the decode-heavy
# workload's mean context, for concurrency from 1 to 512; per generated token, a step without drafts yields one token
# a sequence and a verify step the acceptance length, the labelled assumption `mtp_acceptance_length` (published
# acceptance of Qwen3.5's MTP head, read from `data/costmodel_assumptions.json`).

# %%
import qwen35_lib
from qwen35_lib.costmodel import assumptions, ops, specs
from qwen35_lib.costmodel.step import step_costs
from qwen35_lib.plan import get_stage

MODEL = qwen35_lib.get_config("qwen3.5-397b-a17b")
TPU = specs.get("tpu7x-8")
STAGE = get_stage("kernels")
K = 3  # drafts a sequence
A = assumptions.acceptance_length(K)  # tokens a verify step yields (the assumption at K drafts)
CTX = 1024 + 8192 / 2  # the decode-heavy workload's mean context during decode (1k in, 8k out)
CONCURRENCY = (1, 4, 16, 64, 256, 512)
GROUPS = {"dense weights": ("attn_proj", "gdn_proj", "router", "shared_expert", "norms"),
          "LM head and embedding": ("embed_lm_head", "sampling"),
          "routed experts": ("routed_experts", "permute", "onehot_permute", "moe_rows"),
          "KV cache and GDN state": ("attn_core", "gdn_core", "gdn_conv", "cache_copies")}  # "other": the rest


def step_bytes(c: int, drafts: int) -> dict[str, float]:
    """{group: bytes per device} of one decode step of `c` sequences (every component in one group)."""
    costs = step_costs(MODEL, TPU, STAGE, ops.Batch(decodes=c, decode_ctx=CTX, max_ctx=int(CTX), drafts=drafts),
                       kv_dtype="float8_e4m3fn")
    grouped = {g: sum(costs[n].hbm_bytes for n in names if n in costs) for g, names in GROUPS.items()}
    listed = {n for names in GROUPS.values() for n in names}
    return grouped | {"other": sum(c.hbm_bytes for n, c in costs.items() if n not in listed)}


roof = {c: {d: step_bytes(c, d) for d in (0, K)} for c in CONCURRENCY}
per_token = {c: {0: sum(v[0].values()) / c, K: sum(v[K].values()) / (c * A)} for c, v in roof.items()}
byte_gain = {c: v[0] / v[K] for c, v in per_token.items()}
print(f"acceptance length {A:.2f} at {K} drafts ({assumptions.ACCEPTANCE})")
print(f"{'requests':>8}  {'GB/step':>8}  {'GB/step, k=3':>12}  {'MB/token':>8}  {'MB/token, k=3':>13}  gain")
for c in CONCURRENCY:
    print(f"{c:>8}  {sum(roof[c][0].values()) / 1e9:8.1f}  {sum(roof[c][K].values()) / 1e9:12.1f}  "
          f"{per_token[c][0] / 1e6:8.1f}  {per_token[c][K] / 1e6:13.1f}  x{byte_gain[c]:.2f}")
print()
for c in (1, 16, 512):
    print(f"c{c}: GB a step, without -> with {K} drafts: " + ", ".join(
        f"{g} {roof[c][0][g] / 1e9:.1f} -> {roof[c][K][g] / 1e9:.1f}" for g in roof[c][0]))

# %%
import matplotlib.pyplot as plt

# figure: bytes_per_token
fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
ax.loglog(CONCURRENCY, [per_token[c][0] / 1e6 for c in CONCURRENCY], "o-", label="one token a step")
ax.loglog(CONCURRENCY, [per_token[c][K] / 1e6 for c in CONCURRENCY], "s-", label=f"{K} drafts verified")
ax.set_xlabel("concurrent requests")
ax.set_ylabel("MB per generated token (a device)")
ax.set_title("Bytes per generated token")
ax.legend()
growth = {g: [roof[c][K][g] / roof[c][0][g] for c in CONCURRENCY] for g in GROUPS}  # "other" aside
for g, v in growth.items():
    bx.semilogx(CONCURRENCY, v, "o-", label=g)
bx.axhline(1 + K, color="grey", ls=":", label=f"{1 + K} tokens a sequence")
bx.set_xlabel("concurrent requests")
bx.set_ylabel("bytes with drafts / without")
bx.set_title(f"What a verify step of {K} drafts adds, by part")
bx.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# **Check.** Drafts lower the bytes per generated token at every concurrency, but not by the same factor. At one
# request the step is the dense weights and the ten experts its token picks: drafts read more experts, yet the dense
# weights are shared by the verified tokens. At a middling concurrency the drafts' tokens pick experts no other token in
# the step picked, so the routed experts' bytes grow almost with the tokens: the gain dips. Once a step reads every
# expert anyway, the gain recovers; at 512 the GDN state, written once a verified token as its
# checkpoint, is the largest of what the drafts add, and the gain falls again.

# %%
lo_c, dip_c, top_c, hi_c = 1, 16, 256, 512
expert_growth = {c: roof[c][K]["routed experts"] / roof[c][0]["routed experts"] for c in CONCURRENCY}
added = {g: roof[hi_c][K][g] - roof[hi_c][0][g] for g in roof[hi_c][0]}
notebook.claim("fewer_bytes_everywhere", "with {k} drafts at an acceptance length of {a:.2f}, a token costs fewer "
               "bytes at every concurrency from {c0} to {c1} requests, by x{lo:.2f} to x{hi:.2f}",
               all(g > 1 for g in byte_gain.values()), "every gain > 1", k=K, a=A, c0=CONCURRENCY[0],
               c1=CONCURRENCY[-1], lo=min(byte_gain.values()), hi=max(byte_gain.values()))
notebook.claim("expert_dip", "the gain dips at {dip} requests (x{g_dip:.2f}, against x{g_lo:.2f} at {lo} and "
               "x{g_top:.2f} at {top}), where the drafts' tokens read experts the step would not have read: the routed "
               "experts' bytes grow x{e_dip:.2f} there and x{e_top:.2f} at {top}",
               byte_gain[dip_c] < byte_gain[lo_c] and byte_gain[dip_c] < byte_gain[top_c]
               and expert_growth[dip_c] > expert_growth[top_c], "gain(dip) < gain(lo), gain(top); experts grow more",
               dip=dip_c, lo=lo_c, top=top_c, g_dip=byte_gain[dip_c], g_lo=byte_gain[lo_c], g_top=byte_gain[top_c],
               e_dip=expert_growth[dip_c], e_top=expert_growth[top_c])
notebook.claim_largest("state_at_512", "at {c} requests the gain falls to x{g:.2f} (x{g_top:.2f} at {top}): of what "
                       "the drafts add to a step, the KV cache and GDN state, each verified token's checkpoint, are "
                       "the most", {"state": added["KV cache and GDN state"], "experts": added["routed experts"],
                                "lm_head": added["LM head and embedding"], "dense": added["dense weights"],
                                "other": added["other"]}, "state",
                       c=hi_c, g=byte_gain[hi_c], top=top_c, g_top=byte_gain[top_c])
assert byte_gain[hi_c] < byte_gain[top_c]

# %% [markdown]
# ## 2. Measure: the engine on this machine, with a head distilled here
#
# The test checkpoints' heads are random: they would draft at about one chance in the vocabulary, and a random base
# model's greedy continuation has nothing a head could learn. So the base model gets a structure
# (`bench.mtp.structured_base`: its LM head tied to a permutation of its embedding and each layer's output scaled
# down, so its next token is often a fixed function of the last one), and the head is distilled on the model's own
# greedy continuations (`bench.mtp.distill`: only the head trains, with optax). Then the engine serves the same
# prompts twice, without drafts and with 3 drafts a step (`EngineConfig.speculative_tokens`), each engine compiled
# before it is timed (`bench.mtp.engine_speculation`), and the cost model predicts both runs on this CPU's measured
# rates at the acceptance the engine counted (`bench.mtp.cpu_prediction`).
#
# **Compute.** Distill, serve, predict (a tiny model, two sequences: most of the time is compiling).

# %%
import numpy as np

from qwen35_lib.bench import mtp
from qwen35_lib.weights import init_mtp_weights

cpu_run = None
if devices[0].platform == "cpu":  # the engine measured here runs on the CPU; an accelerator's run is another chapter
    tiny = qwen35_lib.get_config("qwen3.5-tiny", dtype="float32")
    base = mtp.structured_base(qwen35_lib.init_weights(tiny, 0), 0.5)  # next token often pi(last token)
    prompts = mtp.synthetic_prompts(34, 8, tiny.vocab_size, seed=0)  # 32 to learn from, 2 to serve
    train = mtp.greedy_sequences(tiny, base, prompts[:32], 8, desc="greedy continuations")
    head, losses = mtp.distill(tiny, base, init_mtp_weights(tiny, 1), train, steps=40, batch=16)
    # 2 sequences (a budget of 8 a step: both prompts in the first step, so each engine compiles two steps), each
    # engine compiled by an untimed run of the same prompts, then a fresh one timed
    served = mtp.engine_speculation(tiny, base, head, prompts[32:], new_tokens=16, k=K, max_num_seqs=8,
                                    precompile=False)
    predicted = mtp.cpu_prediction(tiny, served)
    cpu_run = dict(loss_first=losses[0], loss_last=losses[-1], acceptance_length=served["acceptance_length"],
                   same_outputs=served["same_outputs"], measured_speedup=served["speedup"],
                   predicted_speedup=predicted["speedup"],
                   measured_tokens_per_s={d: served[d]["output_tokens_per_s"] for d in ("0", str(K))},
                   predicted_tokens_per_s=predicted["output_tokens_per_s"], steps={d: served[d]["steps"] for d in
                                                                                  ("0", str(K))},
                   load=os.getloadavg()[0])
    print(f"distillation: loss {losses[0]:.2f} -> {losses[-1]:.2f}; the engine's acceptance length "
          f"{served['acceptance_length']:.2f} at {K} drafts; greedy outputs identical: {served['same_outputs']}")
    for d in ("0", str(K)):
        print(f"  {d} drafts: measured {served[d]['output_tokens_per_s']:7.0f} output tokens/s in {served[d]['steps']} "
              f"steps, predicted {predicted['output_tokens_per_s'][d]:7.0f}")
    print(f"speedup: measured x{served['speedup']:.2f}, predicted x{predicted['speedup']:.2f} "
          f"(load average {cpu_run['load']:.1f} on {os.cpu_count()} cores)")

# %% [markdown]
# **Check.** The verifier is exact: greedy output with drafts is the output without them, token for token, and the
# drafted run needs fewer steps. The speedup itself is a timing on a shared machine: it is printed beside the
# prediction, with the machine's load, and not asserted (benchmarks report, they do not assert). The prediction
# charges what the roofline of section 1 charges, on this CPU's measured rates; what the engine pays beyond it (an
# unfused verify step's copies, host time between steps) shows as the distance between the two.

# %%
if cpu_run:
    notebook.claim("greedy_is_exact", "served greedily with {k} drafts a step from the distilled head, the engine's "
                   "output equals its output without drafts, token for token, in {s_k} steps instead of {s_0} "
                   "(acceptance length {a:.2f})", served["same_outputs"] and cpu_run["steps"][str(K)] <
                   cpu_run["steps"]["0"], "same outputs, fewer steps", k=K, s_k=cpu_run["steps"][str(K)],
                   s_0=cpu_run["steps"]["0"], a=served["acceptance_length"])
    assert losses[-1] < losses[0], losses
    assert np.isfinite(cpu_run["measured_speedup"]) and np.isfinite(cpu_run["predicted_speedup"])

# %% [markdown]
# ## 3. Predict for TPU7x-8, and check the memory against the compile
#
# Drafts cost memory before they cost time: each running sequence keeps a GDN state checkpoint per verified token
# (the state after each of its verified tokens, so a rejected draft rolls back exactly), and the head brings its own
# weights and KV cache. On TPU7x-8 the GDN state is large, so fewer sequences fit a device.
#
# **Compute.** `costmodel.predict` for the `kernels` stage on the decode-heavy workload with 3 drafts a sequence
# (`speculative_tokens=3`, the acceptance assumption), from 64 to 512 requests: output tokens per second with and
# without drafts, the sequences a rank can hold, and at the ends, the gain at the assumption's low and high values.
# Beside it, the verify step compiled for TPU7x at the 397B shape (`python -m qwen35_lib.aot verify`, stored in
# `data/aot/tpu7x-8-mtp.json`): which request counts fit.

# %%
from qwen35_lib import data
from qwen35_lib.costmodel import predict

TPU_CONC = (64, 128, 256, 512)
tpu = {}
for c in TPU_CONC:
    r = predict(stage="kernels", isl=1024, osl=8192, concurrency=c, roofline=False, speculative_tokens=K)
    s = r["speculation"]
    ends = {end: predict(stage="kernels", isl=1024, osl=8192, concurrency=c, roofline=False, speculative_tokens=K,
                         acceptance_length=s[f"acceptance_{end}"])["speculation"]["output_gain"]
            for end in ("low", "high")} if c in (TPU_CONC[0], TPU_CONC[-1]) else {"low": None, "high": None}
    tpu[c] = dict(output_tokens_per_s=r["output_tokens_per_s"], without=s["without"]["output_tokens_per_s"],
                  gain=s["output_gain"], gain_low=ends["low"], gain_high=ends["high"],
                  running_per_rank=r["max_running_per_rank"], running_without=s["without"]["max_running_per_rank"],
                  requests_per_rank=c / r["dp"], tpot_ms=r["median_tpot_s"] * 1e3,
                  tpot_without_ms=s["without"]["median_tpot_s"] * 1e3)
    band = (f"; acceptance {s['acceptance_low']:.2f}..{s['acceptance_high']:.2f}: "
            f"x{ends['low']:.2f}..x{ends['high']:.2f}") if ends["low"] else ""
    print(f"c{c:<4} {s['without']['output_tokens_per_s']:7,.0f} -> {r['output_tokens_per_s']:7,.0f} output tokens/s "
          f"(x{s['output_gain']:.2f}{band}), {r['max_running_per_rank']} sequences a rank fit "
          f"({s['without']['max_running_per_rank']} without drafts), TPOT {s['without']['median_tpot_s'] * 1e3:.1f} "
          f"-> {r['median_tpot_s'] * 1e3:.1f} ms")
verify = data.read_json("aot/tpu7x-8-mtp.json")
compiled = {int(name.split()[2]): e for name, e in verify["verify"].items() if e["speculative_tokens"] == K}
for n, e in sorted(compiled.items()):
    print(f"compiled verify step, {K} drafts, {n} requests ({n // e['ranks']} a rank): fits {e['fits']}"
          + (f", with the head {e['fits_with_head']}" if "fits_with_head" in e else f" ({e.get('error', '')[:90]})"))

# %%
# figure: tpu_gain
fig, ax = plt.subplots(figsize=(6, 3.6))
ax.plot(TPU_CONC, [tpu[c]["gain"] for c in TPU_CONC], "o-", label=f"{K} drafts, acceptance {A:.2f}")
ends_c = [TPU_CONC[0], TPU_CONC[-1]]
ax.errorbar(ends_c, [tpu[c]["gain"] for c in ends_c], yerr=[[tpu[c]["gain"] - tpu[c]["gain_low"] for c in ends_c],
                                                         [tpu[c]["gain_high"] - tpu[c]["gain"] for c in ends_c]],
            fmt="none", capsize=4, color="C0", alpha=0.6, label="the acceptance assumption's range")
ax.set_xscale("log", base=2)
ax.set_xlabel("concurrent requests (1k/8k)")
ax.set_ylabel("output tokens/s, with drafts / without")
ax.set_title("TPU7x-8, kernels stage: what MTP buys")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# **Check.** Where the checkpoints of every request do not fit, the engine holds fewer sequences a step than the load
# offers, and the gain falls. The compile agrees on where
# that limit lies: the verify step holding every request at the highest concurrency runs out of HBM, a smaller one
# fits.

# %%
full = max(TPU_CONC)
capped = [c for c in TPU_CONC if tpu[c]["running_per_rank"] < tpu[c]["requests_per_rank"]]
with_head = max(n for n, e in compiled.items() if e.get("fits_with_head"))  # the head's weights and KV cache too
alone = max(n for n, e in compiled.items() if e["fits"])  # the verify step's own memory
notebook.claim("tpu_gain", "on TPU7x-8 the model predicts x{g64:.2f} the output tokens per second at {c0} requests "
               "(x{l64:.2f} to x{h64:.2f} over the acceptance assumption's range) and x{g512:.2f} at {c1} (x{l512:.2f} "
               "to x{h512:.2f})", tpu[64]["gain"] > tpu[full]["gain"] > 1, "gain(64) > gain(512) > 1", c0=64,
               c1=full, g64=tpu[64]["gain"], l64=tpu[64]["gain_low"], h64=tpu[64]["gain_high"],
               g512=tpu[full]["gain"], l512=tpu[full]["gain_low"], h512=tpu[full]["gain_high"])
notebook.claim("memory_caps_512", "with drafts a rank holds {run} sequences instead of {run0}, so at {c} requests "
               "({per:.0f} a rank) the engine runs fewer than it is offered; the compiled verify step agrees: with the "
               "head's weights and cache {n_head} requests ({n_head_rank} a rank) fit, without them {n_alone} "
               "({n_alone_rank} a rank), and {n_all} do not",
               capped == [full] and not compiled[full]["fits"]
               and with_head // compiled[with_head]["ranks"] <= tpu[full]["running_per_rank"]
               <= alone // compiled[alone]["ranks"],
               "only the highest concurrency capped; the model's sequences a rank between the compile's with and "
               "without the head", run=tpu[full]["running_per_rank"], run0=tpu[full]["running_without"], c=full,
               per=tpu[full]["requests_per_rank"], n_head=with_head,
               n_head_rank=with_head // compiled[with_head]["ranks"], n_alone=alone,
               n_alone_rank=alone // compiled[alone]["ranks"], n_all=full)

# %%
# Record the numbers for the playbook's results.json (only when the builder asks: $QWEN35_RESULTS_DIR).
record = dict(k=K, acceptance_length=A, tpu_concurrency=list(TPU_CONC), dip=dip_c, assumption=assumptions.ACCEPTANCE,
              context=CTX,
              roofline={str(c): dict(bytes_per_token=per_token[c][0], bytes_per_token_k=per_token[c][K],
                                     gain=byte_gain[c], step_gb=sum(roof[c][0].values()) / 1e9,
                                     step_gb_k=sum(roof[c][K].values()) / 1e9) for c in CONCURRENCY},
              cpu=cpu_run, tpu={str(c): v for c, v in tpu.items()},
              compiled={str(n): dict(fits=e["fits"], per_rank=n // e["ranks"]) for n, e in compiled.items()})
notebook.save_results("mtp", record)

# %% [markdown]
# <div style="border: 2px solid #4C72B0; border-radius: 6px; padding: 0.6em 1em;">
# <b>Takeaway.</b> A verify step shares what a step reads once among every verified token of a sequence, so drafting
# pays wherever the step is bytes; it pays least where the drafts pull in experts nobody else read, and where each
# verified token's GDN checkpoint dominates the step. On TPU7x-8 the checkpoints cost memory first: the gain is
# largest where every request still fits.
# </div>
#
# ## What we learned
#
# - The MTP head drafts, the full model verifies them with the token before them in one step, and greedy acceptance
#   keeps the model's own output; the GDN state rolls back from per-token checkpoints.
# - The roofline predicts the gain component by component: shared weights get cheaper per token, per-token state does
#   not, and an MoE's experts sit in between until every expert is read anyway.
# - On TPU7x-8 the checkpoints' memory, not their bandwidth, sets the limit at the highest concurrency.
#
# ## Exercises
#
# 1. **[Fewer drafts]** At 512 requests, does 1 draft a sequence buy more or less than 3?
#    <details><summary>Answer</summary>
#
#    Predict `predict(stage="kernels", isl=1024, osl=8192, concurrency=512, speculative_tokens=k)` for k = 1 and 3 and
#    compare `speculation.output_gain` and `max_running_per_rank`: fewer drafts keep fewer checkpoints a sequence, so
#    more sequences fit, against fewer tokens a step.
#    </details>
#
# 2. **[A better head]** How does the gain at the lowest concurrency of section 3 move with the acceptance
#    length?
#    <details><summary>Answer</summary>
#
#    Pass `acceptance_length` from one (no draft ever accepted) to one more than the drafts (all accepted) to the same
#    `predict`: at one the drafts are pure cost, a slowdown; the gain grows with each accepted token.
#    </details>

# %% [markdown]
# **The answers, computed.** From this run, folded until you open them.

# %%
one = predict(stage="kernels", isl=1024, osl=8192, concurrency=512, roofline=False, speculative_tokens=1)
notebook.answer(1, "at 512 requests, 1 draft gives x{g1:.2f} with {r1} sequences a rank, 3 drafts x{g3:.2f} with {r3}.",
                g1=one["speculation"]["output_gain"], r1=one["max_running_per_rank"], g3=tpu[512]["gain"],
                r3=tpu[512]["running_per_rank"])
worst = predict(stage="kernels", isl=1024, osl=8192, concurrency=64, roofline=False, speculative_tokens=K,
                acceptance_length=1.0)["speculation"]["output_gain"]
best = predict(stage="kernels", isl=1024, osl=8192, concurrency=64, roofline=False, speculative_tokens=K,
               acceptance_length=K + 1.0)["speculation"]["output_gain"]
notebook.answer(2, "at 64 requests: x{w:.2f} when no draft is accepted, x{a:.2f} at the assumed {al:.2f}, x{b:.2f} "
                "when all are.", w=worst, a=tpu[64]["gain"], al=A, b=best)
