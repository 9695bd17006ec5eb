"""The cost model against hand-computed cases, and its public contracts (no device work; a few seconds)."""

from __future__ import annotations

import re

import pytest

from qwen35_lib import costmodel
from qwen35_lib.plan import ServingPlan


def test_predict_contract_and_fit():
    r = costmodel.predict("qwen3.5-397b-a17b", "tpu7x-8", "kernels", isl=1024, osl=1024, concurrency=64)
    assert r["fits"] and r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > r["output_tokens_per_s"]
    assert r["total_tokens_per_s_per_chip"] == pytest.approx(r["total_tokens_per_s"] / 4)
    assert sum(r["breakdown_fraction"].values()) == pytest.approx(1.0)
    assert 0 < r["fraction_of_roofline"] <= 1.0
    small = costmodel.predict("qwen3.5-397b-a17b", "v6e-8", "kernels", 1024, 1024, 64)
    assert not small["fits"] and "weights need" in small["reason"]
    with pytest.raises(ValueError, match="KV heads cannot be split"):
        costmodel.predict(stage=ServingPlan("naive", "tp8"), isl=1024, osl=1024, concurrency=8)


# --- arguments and the bounded simulation ----------------------------------------------------------------------
# predict() of commit d4a4921 (before the simulation was bounded), tpu7x-8, the serving model:
# (stage, isl, osl, concurrency) -> (total tokens/s, roofline total tokens/s, steps). `baseline` is DP 1, so at
# 512 concurrency it plays 1024 requests per rank, the most of these cases. The `kernels` totals since: the EP
# permute is charged the code's static buffer (N·min(k, E/ep) rows per device), not the N·k/ep local copies. All
# totals since: the collectives of the whole step (`costmodel.traffic`, checked against the compiled HLO), not
# only the layers': `baseline` adds the vocab-split embedding's all-reduce and the logits' all-gather before
# sampling (-0.2 % to -1.2 %), `kernels` the sampling's greedy-flag all-reduce and next-token all-gather (-0.2 %).
# The `kernels` totals since issue 30: its MoE is production's layer (`costmodel.moe_layer`), which moves two
# N·k-row buffers [N·k, D] (one write, one read) instead of the static buffer's four passes; without mechanisms
# there is no one-hot permute (threshold 0) and no per-row overhead (+1 % to +19 %); and the sampler's next-token
# gather priced as the all-reduce TPU7x compiles it. All totals since issue 30 item 4 (the model's bytes against the
# compiled TPU7x-8 decode steps' HLO text, `costmodel.compiled`): the engine's layer scan copies each layer's whole
# cache pools five times a step (then `stacked_cache_copy_passes`), the dense projections are sliced scan inputs in
# every kernel family (3 passes), `kernels` runs this library's MoE layer around its Pallas grouped matmul (8.3 passes
# over the routed rows, no one-hot permute; tpu-inference's layer is its plans' only: x0.39 to x0.95 for `kernels`),
# and the baseline's XLA kernels move what their compiled ops move: the paged attention 31.7 B per KV element read,
# the FP8 experts 20.4 B per parameter, the GDN state 7 passes (x0.12 to x0.31). All totals since issue 50: the
# engine's caches are rows of one pool a kind, updated in place (`kernels.engine_cache_copy_passes` = 0, measured),
# and the dense weights' slices move what the kernels stage's compile shows (`xla_weight_passes` 3.58, was 3):
# x1.03 to x1.13 for `baseline`, x1.09 to x1.94 for `kernels`. Then (issue 50): the kernels stage's projections read
# the stacks in place (`pallas_dense_weight_passes` 1.03) and its routed rows move 3.5 times (was 8.3); XLA's dots move
# the dense weights 4.36 times (dp_ep's compile, was 3.58 from the kernels stage's): x1.50 to x1.67 for `kernels`,
# x0.998 to x1.000 for `baseline`. Rooflines and step counts unchanged. Then (issue 50, the compile's bytes counted in
# HBM only, VMEM's left out, and the step's glue priced): the sampler's passes over the logits, the conv's rows (in
# the rooflines too), the router on XLA's sliced scan beside the Pallas projections (3 passes), the grouped matmul's
# FP8 scales expanded along lanes, the routed rows moved 3 times (was 3.5), the projections 1.00 and XLA's dots 4.31
# times: x0.96 to x1.01 for `kernels`, x0.99 to x1.00 for `baseline`, rooflines x0.99 to x1.00, steps unchanged.
# Then (issue 50, one engine): the XLA family's attention runs by items on the TPU too (a mixed step's prompt tokens
# read the pages once an item of 16, not once a token), its FP8 pool stored as uint32 words (no relayout of the pool
# around each write), and the XLA kernels' facts read off the new dp_ep texts (the walk 19.6 B a value read, the
# items' 36.0, the FP8 experts 20.3 B a parameter, the GDN state 4 passes, the dots 4.12): x1.05 to x2.62 for
# `baseline` (most at 8k/1k, its mixed steps), `kernels`, rooflines and steps unchanged. Then (issue 50, the XLA
# attention reads each sequence's own context: rows sorted by context in groups of WALK_ROWS, each walking to its
# own longest): x1.02 to x1.17 for `baseline`, `kernels`, rooflines and steps unchanged. Then (issue 50, the XLA
# stages re-compiled with the groups: a group's gathered pages and scores stay in VMEM, the walk 3.3 B a KV value read
# (was 19.6), the items 8.0 (36.0); the TP baseline's FP8 experts 12.4 B a parameter, read off its own compile (it
# was priced at EP's 20.3)): x1.66 to x1.90 for `baseline`, `kernels`, rooflines and steps unchanged. Then (issue 50,
# item 2: the kernels stage's XLA glue around its Pallas kernels, `ops.glue`, and its combine's float32 sums in HBM
# once too large for VMEM, both read off its mixed step's compile): `kernels` x0.87 to x0.99, the rest unchanged. Then
# (issue 50: the Pallas combine writes bf16 sums, no float32 [N, D] in HBM; the hierarchical reduce-scatter's slices
# 2.0 passes, was 2.88, its tokens gathered in its device order; re-read off the recompiled kernels stage):
# `kernels` x1.00 to x1.03, the rest unchanged.
BEFORE = {
    ('baseline', 8192, 1024, 64): (2228.309508962479, 40746.69099369322, 2229),
    ('kernels', 8192, 1024, 64): (19623.111135166724, 44434.37219714788, 2030),
    ('baseline', 1024, 8192, 64): (324.65990255475094, 6314.657262827242, 16248),
    ('kernels', 1024, 8192, 64): (3278.1053431555756, 6361.624932950116, 15838),
    ('baseline', 8192, 1024, 512): (6185.967299111642, 92157.35915759462, 5100),
    ('kernels', 8192, 1024, 512): (48376.52400621971, 144878.7568651295, 2466),
    ('baseline', 1024, 8192, 512): (2136.612033300154, 27564.308014343587, 16752),
    ('kernels', 1024, 8192, 512): (14919.432125634868, 27960.880882333484, 16248),
}


# Since issue 13 the default prediction adds the labelled mechanisms and one token-budget rule for every stage;
# with `mechanisms="off"` and the budget of the rule before (min(max(ISL / DP, 1024), 2048) per rank) it is unchanged.
@pytest.mark.parametrize("case", list(BEFORE), ids=lambda c: "-".join(map(str, c)))
def test_predictions_at_normal_concurrency_are_unchanged(case):
    stage, isl, osl, conc = case
    dp = 1 if stage == "baseline" else 8
    r = costmodel.predict("qwen3.5-397b-a17b", "tpu7x-8", stage, isl, osl, conc, mechanisms="off",
                          max_batched_tokens=min(max(isl // dp, 1024), 2048), max_seqs=max(1, 2 * conc // dp),
                          num_prompts=2 * conc)  # the defaults before issue 30 (now the recipe's, 10 x CONC prompts)
    total, roofline, steps = BEFORE[case]
    assert r["played_requests_per_rank"] == r["requests_per_rank"]  # every request played
    assert r["total_tokens_per_s"] == pytest.approx(total, rel=1e-9)
    assert r["roofline_total_tokens_per_s"] == pytest.approx(roofline, rel=1e-9)
    assert r["steps"] == steps


@pytest.mark.parametrize("changes, message", [
    (dict(concurrency=0), "concurrency=0 (--concurrency): requests in flight must be an integer >= 1"),
    (dict(concurrency=-5), "concurrency=-5"),
    (dict(concurrency=2.5), "concurrency=2.5"),
    (dict(concurrency=True), "concurrency=True"),
    (dict(max_batched_tokens=-5), "max_batched_tokens=-5 (--max-batched-tokens)"),
    (dict(max_batched_tokens=0), "max_batched_tokens=0"),  # was: the default
    (dict(max_seqs=0), "max_seqs=0 (--max-seqs)"),
    (dict(isl=0), "isl=0 (--isl): input tokens per request"),  # was numpy's 'low >= high'
    (dict(osl=-1), "osl=-1 (--osl)"),
    (dict(page_size=0), "page_size=0: tokens per KV-cache page"),
    (dict(num_prompts=0), "num_prompts=0: requests in the benchmark"),
    (dict(kv_dtype="foo"), "kv_dtype='foo' is not a KV-cache dtype; use one of float32, bfloat16, float8_e4m3fn"),
])
def test_predict_checks_its_arguments(changes, message):
    args = {**dict(isl=1024, osl=1024, concurrency=8), **changes}
    with pytest.raises(ValueError, match=re.escape(message)):
        costmodel.predict("qwen3.5-397b-a17b", "tpu7x-8", "kernels", **args)
    with pytest.raises(ValueError, match=re.escape(message.split(" ")[0])):
        costmodel.ladder(workloads=((args.pop("isl"), args.pop("osl")),), stages=("kernels",), **args)


def test_predict_returns_at_a_billion_concurrent_requests():
    """The simulation does not grow with concurrency (it used to: 1e9 was a MemoryError)."""
    r = costmodel.predict("qwen3.5-397b-a17b", "tpu7x-8", "kernels", isl=1024, osl=1024, concurrency=10**9)
    assert r["fits"] and r["requests_per_rank"] == 10 * 10**9 // 8  # InferenceX's 10 x concurrency prompts
    assert r["played_requests_per_rank"] < 2000 and r["mean_running_per_rank"] <= r["max_running_per_rank"]
    assert 0 < r["total_tokens_per_s"] and 0 < r["fraction_of_roofline"] <= 1
    # every request's tokens are counted (lengths drawn in [r·L, L]): at most max_running_per_rank per rank a step
    out_per_rank = r["output_tokens_per_s"] * r["seconds"] / r["dp"]
    assert out_per_rank > 0.75 * r["requests_per_rank"] * 1024
    assert r["steps"] >= out_per_rank / r["max_running_per_rank"]


def test_gdn_layers_fixed_time_is_added_once_a_gdn_layer_to_every_step():
    """`gdn_layer_fixed_s` (issue 55, item 2; tpu-inference #2671's per-layer GDN times at zero tokens): every step
    on a TPU pays it once per GDN layer, in `gdn_core`; the roofline bound does not; its band ends move the band."""
    from qwen35_lib.costmodel.assumptions import Mechanisms, records
    from qwen35_lib.costmodel.ops import sizes

    rec = records()["gdn_layer_fixed_s"]
    assert rec["kind"] == "range" and rec["low"] < rec["value"] < rec["high"]
    args = ("qwen3.5-397b-a17b", "tpu7x-8", "tpu_inference_3050", 1024, 1024, 8)
    on = costmodel.predict(*args, mechanisms=Mechanisms.nominal())
    off = costmodel.predict(*args, mechanisms=Mechanisms.nominal(gdn_layer_fixed_s=0.0))
    n_gdn = sizes(costmodel.serving_model())["n_gdn"]
    assert on["steps"] == off["steps"] and n_gdn == 45
    added = on["breakdown_s"]["gdn_core"] - off["breakdown_s"]["gdn_core"]
    assert added == pytest.approx(n_gdn * rec["value"], rel=1e-9)
    assert on["mean_step_s"] - off["mean_step_s"] == pytest.approx(added, rel=1e-9)
    assert on["roofline_total_tokens_per_s"] == pytest.approx(off["roofline_total_tokens_per_s"], rel=1e-12)
    assert on["median_tpot_s"] > off["median_tpot_s"]
    band = costmodel.predict(*args, band=True, roofline=False)["band"]
    ends = {e["end"]: e for e in band["extremes"] if e["assumption"] == "gdn_layer_fixed_s"}
    assert ends["low"]["total_tokens_per_s"] > on["total_tokens_per_s"] > ends["high"]["total_tokens_per_s"]
