"""The cost model's speculative decoding (issue 54, item 4a): a verify step of k drafts a decode row, the MTP head's
draft step, the GDN checkpoints, the schedule at an acceptance length, and predict's option and assumption."""

from __future__ import annotations

import dataclasses

import pytest

from qwen35_lib.costmodel import assumptions, ops, specs, step
from qwen35_lib.costmodel.predict import predict, resident_bytes_per_device, serving_model
from qwen35_lib.costmodel.schedule import NO_SPEC, Speculation, simulate
from qwen35_lib.plan import any_stage

CFG = serving_model()
TPU = specs.get("tpu7x-8")
DECODE = ops.Batch(decodes=512, decode_ctx=4096.0, max_ctx=8192)
MIXED = ops.Batch(decodes=504, decode_ctx=4096.0, prefill_tokens=8192, prefill_seqs=8, prefill_ctx=1024.0,
                  max_ctx=8192)
# step_time(...).hbm_bytes, .flops of these batches at 397B on TPU7x-8 as priced before speculation was added
# (commit 9a18120, the same code run from `git archive`): no drafts, no change; the kernels stage's bytes since
# issue 50, item 2 priced its XLA glue around the Pallas kernels (`ops.glue`) and its combine's float32 sums
# (97.47 / 246.44 GB before), and since its combine writes bf16 sums and its hierarchical reduce-scatter's slices
# moved 2.0 passes instead of 2.88 (100.63 / 321.35 GB before)
BEFORE = {("kernels", "decode"): (100405466643.31401, 2241592770560.0),
          ("kernels", "mixed"): (300492358569.6, 35179682374400.0),
          ("dp_ep", "decode"): (1102041419520.0, 2273962311680.0),
          ("dp_ep", "mixed"): (1342409085456.0, 38644993483520.0)}


def _time(stage: str, batch: ops.Batch) -> step.StepTime:
    return step.step_time(CFG, TPU, any_stage(stage), batch, "float8_e4m3fn", 256)


@pytest.mark.parametrize("stage,kind", list(BEFORE))
def test_without_drafts_the_priced_step_is_todays(stage, kind):
    t = _time(stage, {"decode": DECODE, "mixed": MIXED}[kind])
    assert (t.hbm_bytes, t.flops) == pytest.approx(BEFORE[stage, kind], rel=1e-12)


def test_a_verify_step_costs_more_with_each_draft_and_less_per_token_at_the_assumed_acceptance():
    """Bytes and seconds grow with k; the step's k + 1 tokens a row are all computed (FLOPs about x (k + 1) in the
    layers); the MoE's bytes grow little at c512 (every expert is read already); per generated token at the assumed
    acceptance length the step is cheaper than decoding one token at a time."""
    t = [_time("kernels", dataclasses.replace(DECODE, drafts=k)) for k in range(4)]
    costs = [step.step_costs(CFG, TPU, any_stage("kernels"), dataclasses.replace(DECODE, drafts=k), "float8_e4m3fn")
             for k in range(4)]
    for a, b in zip(t, t[1:]):
        assert a.hbm_bytes < b.hbm_bytes and a.seconds < b.seconds and a.flops < b.flops
    routed = [c["routed_experts"].hbm_bytes for c in costs]
    assert routed[3] / routed[0] < 1.15, routed  # c512: ~all 512 experts read at k = 0 already
    assert 3.0 < t[3].flops / t[0].flops < 4.5
    for k in (1, 2, 3):
        assert t[k].seconds / assumptions.acceptance_length(k) < t[0].seconds, k
    # the GDN checkpoints: k + 1 states written and one kept a row and layer, on top of the decode's passes
    gdn = [c["gdn_core"].hbm_bytes for c in costs]
    state = CFG.gdn_num_v_heads * CFG.gdn_k_head_dim * CFG.gdn_v_head_dim * 2  # bf16, one sequence, one layer
    rows = 512 / 8 * ops.sizes(CFG)["n_gdn"]  # decode rows a device holds, times GDN layers
    assert gdn[1] - gdn[0] == pytest.approx(rows * 4 * state, rel=0.05)  # (V + 2) passes, V = 2
    assert gdn[3] - gdn[2] == pytest.approx(rows * state, rel=0.05)


def test_the_schedule_emits_the_acceptance_length_a_step():
    plain = lambda batches: step_fn(batches)  # noqa: E731
    args = (1024, 256, 16, 1, 4096, 64, 64, 32)
    off = simulate(plain, *args)
    assert simulate(plain, *args, spec=NO_SPEC) == off
    on = simulate(plain, *args, spec=Speculation(3, 2.5))
    assert on.output_tokens == off.output_tokens and on.input_tokens == off.input_tokens
    decode_steps = lambda r: r.steps  # noqa: E731
    assert 2.0 < decode_steps(off) / decode_steps(on) < 2.6
    with pytest.raises(ValueError, match=r"acceptance length of k drafts lies in \[1, k \+ 1\]"):
        Speculation(1, 2.5)


def step_fn(batches):
    import numpy as np

    return np.ones(len(batches)), {"x": np.ones(len(batches))}


def test_the_acceptance_assumption_has_its_source_and_a_rate_for_other_draft_counts():
    rec = assumptions.records()[assumptions.ACCEPTANCE]
    assert rec["kind"] == "option" and rec["source"].startswith("https://huggingface.co/")
    assert assumptions.acceptance_length(rec["drafts"]) == rec["value"]
    a = [assumptions.acceptance_length(k) for k in range(5)]
    assert a[0] == 1 and all(x < y <= k + 2 for k, (x, y) in enumerate(zip(a, a[1:])))
    assert assumptions.acceptance_length(3, "low") < a[3] < assumptions.acceptance_length(3, "high")


def test_predict_names_the_assumption_and_charges_the_checkpoints_and_the_head_to_memory():
    kw = dict(stage="kernels", isl=1024, osl=256, concurrency=16, roofline=False)
    r = predict(**kw, speculative_tokens=3)
    s = r["speculation"]
    assert s["assumption"] == "mtp_acceptance_length" and s["acceptance_length"] == 3.28
    assert s["assumption_source"].startswith("https://") and s["acceptance_low"] < 3.28 < s["acceptance_high"]
    assert s["output_gain"] > 1 and s["without"]["output_tokens_per_s"] < r["output_tokens_per_s"]
    g = predict(**kw, speculative_tokens=3, acceptance_length=2.0)["speculation"]
    assert g["acceptance_source"] == "given" and "assumption" not in g and g["output_gain"] < s["output_gain"]
    # memory: each request's k + 1 state checkpoints in every GDN layer, and its pages of the head's pool
    lay = step.bind_to(any_stage("kernels"), CFG, TPU)
    state = CFG.gdn_num_v_heads * CFG.gdn_k_head_dim * CFG.gdn_v_head_dim * 2
    assert s["gdn_checkpoint_bytes_per_request"] == pytest.approx(4 * state * ops.sizes(CFG)["n_gdn"], rel=0.03)
    assert r["request_bytes_per_device"] > predict(**kw)["request_bytes_per_device"] + \
        s["gdn_checkpoint_bytes_per_request"]
    one = resident_bytes_per_device(CFG, TPU, lay, 1, 1280, "float8_e4m3fn", 256, 3)
    assert one["mtp_weight_bytes"] == s["mtp_weight_bytes_per_device"] > 0 and one["mtp_kv_bytes"] > 0
    assert r["max_running_per_rank"] < predict(**kw)["max_running_per_rank"]
    with pytest.raises(ValueError, match="speculative_tokens"):
        predict(**kw, speculative_tokens=-1)
