"""The ladder's gain attributed (`costmodel.attribution`): the 2 x 2 of {TP, DP + EP} x {XLA, Pallas kernels}, each
effect a ratio of two corners that differ in one thing, and the collective steps as variants of `kernels`."""

from __future__ import annotations

import dataclasses
import math

import pytest

from qwen35_lib.costmodel import attribution as attr
from qwen35_lib.plan import any_stage, get_stage

# made-up throughputs (tokens/s) per plan name and workload: the arithmetic is checked on these, no predict run
RATES = {"baseline": (10.0, 4.0), "google_baseline": (30.0, 12.0), "hier_rs": (12.0, 3.5), "kernels": (48.0, 14.0),
         "dp_ep_pallas": (40.0, 13.0), "replicate_pallas": (46.0, 13.5), "fused_ag_pallas": (47.0, 13.8)}


def _fake_predictions() -> dict:
    return {(name, wl): dict(fits=True, total_tokens_per_s=rates[i], max_running_per_rank=64)
            for name, rates in RATES.items() for i, wl in enumerate(attr.WORKLOADS)}


@pytest.fixture(scope="module")
def record() -> dict:
    return attr.attribution(predictions=_fake_predictions())


def test_the_corners_are_the_stages_that_differ_in_one_thing():
    plan = {k: any_stage(v) for k, v in attr.CORNERS.items()}
    for layout in ("tp", "dp_ep"):  # same layout, kernels differ
        xla, pallas = plan[layout, "xla"], plan[layout, "pallas"]
        assert (xla.kernels, pallas.kernels) == ("xla", "pallas")
        assert dataclasses.replace(pallas, name=xla.name, kernels="xla") == xla, (xla, pallas)
    for kernels in ("xla", "pallas"):  # same kernels, layout differs
        assert plan["tp", kernels].layout == "tp8_kvrep" and plan["dp_ep", kernels].layout == "dp8_ep8"
        assert plan["tp", kernels].kernels == plan["dp_ep", kernels].kernels == kernels


def test_each_collective_variant_is_kernels_with_another_stages_collectives():
    kernels = get_stage("kernels")
    for name, of in attr.COLLECTIVE_STEPS:
        v = attr.collective_variant(name, of)
        assert v.name == name and v.kernels == kernels.kernels
        assert dataclasses.replace(v, name=of, kernels=get_stage(of).kernels) == get_stage(of), (name, v)


def test_the_effects_are_ratios_of_corners_and_multiply_to_the_end_to_end(record):
    for i, wl in enumerate(attr.WORKLOADS):
        e, r = record[wl], {n: v[i] for n, v in RATES.items()}
        assert e["kernels_under_tp"] == pytest.approx(r["google_baseline"] / r["baseline"])
        assert e["layout_with_xla"] == pytest.approx(r["hier_rs"] / r["baseline"])
        assert e["end_to_end"] == pytest.approx(e["layout_with_xla"] * e["kernels_under_dp_ep"])
        assert e["end_to_end"] == pytest.approx(e["kernels_under_tp"] * e["layout_with_pallas"])
        assert e["layout_share"] + e["kernels_share"] == pytest.approx(1)
        assert e["kernels_share"] == pytest.approx(
            (math.log(e["kernels_under_tp"]) + math.log(e["kernels_under_dp_ep"])) / 2 / math.log(e["end_to_end"]))
        steps = record["collectives"][wl]
        assert steps["total"] == pytest.approx(r["kernels"] / r["dp_ep_pallas"])
        assert math.prod(steps[n]["gain"] for n, _ in attr.COLLECTIVE_STEPS) == pytest.approx(steps["total"])


def test_the_memory_comes_from_the_stored_sweep(record):
    m = {stage: c["memory"] for stage, c in record["corners"].items()}
    assert not m["google_baseline"]["compiled"]  # the sweep compiles the ladder's stages only
    base = m["baseline"]["decode"]
    assert not base["fits"] and base["total_bytes"] > m["baseline"]["usable_bytes"]  # the refusal's footprint
    assert m["kernels"]["decode"]["fits"] and m["kernels"]["decode"]["headroom_bytes"] > 0


def test_a_corner_that_does_not_fit_is_refused_with_the_fix():
    made = _fake_predictions()
    made["baseline", "8k/1k"] = dict(fits=False, reason="KV cache")
    with pytest.raises(ValueError, match="lower the concurrency"):
        attr.attribution(predictions=made)


def test_the_table_names_every_corner(record):
    text = attr.attribution_table(record)
    assert "kernels buy x3.00" in text and "not in the stored sweep" in text and "REFUSED" in text, text


def test_expert_bytes_separates_the_weights_from_the_rows():
    """`stage_gain.expert_bytes`: the Pallas grouped matmul reads each FP8 expert parameter once (one byte) and the
    float32 block scales it takes repeated along 128 lanes (4 B per 128 parameters); XLA's path costs more per
    parameter, what each layout's compile moves (EP's whole local experts, TP's slices of every expert: the facts
    `xla_tpu_fp8_expert_bytes` and `_tp`); too few requests to hit every expert is refused."""
    from qwen35_lib.costmodel.step import kernel_facts
    from qwen35_lib.stage_gain import expert_bytes

    got = {st: expert_bytes(st) for st in ("kernels", "google_baseline", "hier_rs", "baseline")}
    assert got["kernels"]["bytes_per_param"] == pytest.approx(1 + 4 / 128, rel=0.01), got  # float8_e4m3fn: one byte
    assert got["google_baseline"]["bytes_per_param"] == pytest.approx(got["kernels"]["bytes_per_param"], rel=1e-3)
    facts = kernel_facts()
    assert got["hier_rs"]["bytes_per_param"] == pytest.approx(facts["xla_tpu_fp8_expert_bytes"]["value"], rel=1e-3)
    assert got["baseline"]["bytes_per_param"] == pytest.approx(facts["xla_tpu_fp8_expert_bytes_tp"]["value"],
                                                               rel=1e-3)
    assert min(got["hier_rs"]["bytes_per_param"], got["baseline"]["bytes_per_param"]) > \
        2 * got["kernels"]["bytes_per_param"], got
    assert got["kernels"]["local_experts"] == 64 and got["baseline"]["local_experts"] == 512
    with pytest.raises(ValueError, match="use more requests"):
        expert_bytes("kernels", requests=8)
