"""The cost model's labelled serving mechanisms (issue 13): every assumption has a source, a quote and a range; the
data-parallel ranks in lockstep; `--explain`; one token budget for every stage; the admission lag."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from qwen35_lib import costmodel
from qwen35_lib.costmodel import assumptions
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.plan import LADDER

SMALL = dict(isl=1024, osl=256, concurrency=16, roofline=False)


def test_every_assumption_has_a_source_a_quote_and_a_range():
    recs = assumptions.records()
    assert {"dp_lockstep", "dp_batch_prefill", "moe_chunk", "host_step_overhead_s", "expert_imbalance",
            "collective_overlap", "sparsecore_permute", "fp8_allgather", "mixed_step_attention",
            "attention_kernel_efficiency", "gmm_tile_rows"} <= set(recs)
    for name, rec in recs.items():
        assert rec["source"].startswith("https://") and len(rec["quote"]) > 20, name
        if rec["kind"] == "range":
            assert rec["low"] <= rec["value"] <= rec["high"] and rec["low"] < rec["high"], name
    # every field of Mechanisms is a record (no mechanism without its assumption)
    assert {f for f in Mechanisms.__dataclass_fields__} <= set(recs)


@pytest.mark.parametrize("field", assumptions.REQUIRED)
def test_an_assumption_without_its_source_quote_or_range_is_refused(field):
    rec = dict(assumptions.records()["expert_imbalance"])
    del rec[field]
    with pytest.raises(ValueError, match=f"lacks {field}"):
        assumptions.check("x", rec)
    with pytest.raises(ValueError, match="is not a URL"):
        assumptions.check("x", dict(assumptions.records()["expert_imbalance"], source="my notes"))
    with pytest.raises(ValueError, match="outside its range"):
        assumptions.check("x", dict(assumptions.records()["expert_imbalance"], value=2.0))


def test_the_model_without_mechanisms_is_the_old_model():
    off = costmodel.predict(stage="kernels", mechanisms="off", **SMALL)
    nominal = costmodel.predict(stage="kernels", **SMALL)
    assert off["mechanisms"] == "off" and not off["dp_lockstep_applied"] and nominal["dp_lockstep_applied"]
    assert off["breakdown_s"]["host"] == 0 and nominal["breakdown_s"]["host"] == pytest.approx(5e-4)
    assert off["total_tokens_per_s"] != nominal["total_tokens_per_s"]


def test_async_scheduling_is_a_setup_switch_for_the_host_time():
    on = costmodel.predict(stage="kernels", **SMALL)
    off = costmodel.predict(stage="kernels", mechanisms=Mechanisms.nominal(async_scheduling=False), **SMALL)
    recs = assumptions.records()
    assert recs["async_scheduling"]["kind"] == "setup" and recs["async_scheduling"]["value"] is True
    assert on["breakdown_s"]["host"] == pytest.approx(recs["host_step_overhead_s"]["value"])
    assert off["breakdown_s"]["host"] == pytest.approx(recs["host_step_time_sync_s"]["value"])


def test_cli_explain_json_gives_the_breakdown_the_band_and_every_assumption():
    out = subprocess.run([sys.executable, "-m", "qwen35_lib.costmodel", "predict", "--isl", "1024", "--osl", "256",
                          "--concurrency", "16", "--explain", "--json"], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    e = doc["explain"]
    assert sum(c["seconds"] for c in e["components"].values()) == pytest.approx(doc["mean_step_s"], rel=1e-6)
    assert all(c["assumptions"] for c in e["components"].values())
    applied = {k: m for k, m in e["mechanisms"].items() if m["applied"]}
    assert {"dp_lockstep", "host_step_overhead_s", "collective_overlap"} <= set(applied)
    assert all(m["assumption"]["source"].startswith("https://") for m in e["mechanisms"].values())
    assert "moe_chunk" in e["other_assumptions"] and "band" in doc
    text = subprocess.run([sys.executable, "-m", "qwen35_lib.costmodel", "predict", "--isl", "1024", "--osl",
                           "256", "--concurrency", "16"], capture_output=True, text=True, check=True).stdout
    assert "band" in text and "the labelled assumptions at their ends: one at a time, and all at once" in text


@pytest.mark.parametrize("isl", [8192, 1024])
def test_one_token_budget_for_every_stage(isl):
    """The slice's token budget is the recipe's (8 x max(ISL / 8, 1024)) under every stage, TP or DP."""
    for stage in (*LADDER, "google_baseline"):
        r = costmodel.predict(stage=stage, isl=isl, osl=256, concurrency=8, roofline=False, mechanisms="off")
        assert r["max_batched_tokens_per_rank"] * r["dp"] == 8 * max(isl // 8, 1024), stage


def test_acceptance_figures_from_comparison_rows():
    from qwen35_lib.costmodel import validate

    rows = [dict(acceptance=True, concurrency=c, ratio_kernels=r, tpot_ratio_kernels=t, inside_band=True,
                 tpot_inside_band=True) for c, r, t in ((64, 1.1, 0.8), (128, 1.2, 0.9), (256, 1.3, 1.3))]
    a = validate.acceptance(rows + [dict(acceptance=False, concurrency=64, ratio_kernels=9.0)], stage="kernels")
    assert a["trend"] == pytest.approx(1.3 / 1.1 - 1) and not a["trend_ok"]
    assert [p["within_25pct"] for p in a["points"]] == [True, True, False]
    assert [p["tpot_within_25pct"] for p in a["points"]] == [True, True, False] and not a["all_within_25pct"]
    assert a["all_inside_band"] and a["stage"] == "kernels"


def test_the_dp_scheduler_holds_new_requests_only_under_async_scheduling():
    """tpu-inference's DP scheduler holds new requests (DP_SCHED_BATCH_PREFILL) only while a schedule is cached, which
    async scheduling's batch queue keeps and a synchronous step drops before the core reads new requests
    (`assumptions.dp_dispatch`): without async scheduling the schedule is the one routing requests as they arrive."""
    assert assumptions.dp_dispatch(Mechanisms.nominal()) == "batch"
    for m in (Mechanisms.nominal(async_scheduling=False), Mechanisms.nominal(dp_batch_prefill=False), Mechanisms.off()):
        assert assumptions.dp_dispatch(m) == "each"
    sync = Mechanisms.nominal(async_scheduling=False)
    held, routed = (costmodel.predict(stage="kernels", mechanisms=m, **SMALL)
                    for m in (sync, dataclasses.replace(sync, dp_batch_prefill=False)))
    assert held["dp_lockstep_applied"]
    assert held["median_ttft_s"] == routed["median_ttft_s"]
    assert held["total_tokens_per_s"] == routed["total_tokens_per_s"]
    hold = costmodel.predict(stage="kernels", **SMALL)  # async scheduling on: the hold holds
    assert hold["median_ttft_s"] != costmodel.predict(stage="kernels", mechanisms=Mechanisms.nominal(
        dp_batch_prefill=False), **SMALL)["median_ttft_s"]


def test_admission_lag_is_two_steps_with_async_scheduling_and_one_without():
    """`assumptions.admit_lag`: the steps vLLM's engine core has in flight when it next reads its input queue."""
    assert assumptions.admit_lag(Mechanisms.nominal()) == 2
    assert assumptions.admit_lag(Mechanisms.nominal(async_scheduling=False)) == 1
    assert assumptions.admit_lag(Mechanisms.nominal(request_path_steps=1)) == 3
    assert assumptions.admit_lag(Mechanisms.off()) == 0
