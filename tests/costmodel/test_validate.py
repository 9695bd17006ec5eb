"""The cost model's validations, their arithmetic: a step case's Batch by hand, the MoE row constant recovered from
cells built with it, the MoE comparison's roles and ratios, the published comparison's plumbing (on a fake
`predict`) and the acceptance figures of hand-made rows."""

from __future__ import annotations

import sys

import pytest

from qwen35_lib.costmodel import validate
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.moe_layer import layer_time
from qwen35_lib.costmodel.predict import serving_model
from qwen35_lib.costmodel.specs import get

M = validate.MEASURED_STAGE


def test_case_batch_by_hand():
    b = validate.case_batch(validate.StepCase("mix", (96, 32), ((64, 0), (16, 48))), D=2, T=98, S=8)
    assert (b.decodes, b.decode_ctx, b.prefill_tokens, b.prefill_seqs, b.prefill_ctx) == (2, 64.0, 80, 2, 24.0)
    assert (b.max_ctx, b.padded_tokens, b.logit_rows) == (96, 98, 8)
    only = validate.case_batch(validate.StepCase("prefill", (), ((64, 0),)), D=1, T=65, S=8)
    assert (only.decodes, only.decode_ctx, only.max_ctx) == (0, 0.0, 64)
    assert [c.name for c in validate.default_cases()] == ["decode x1", "decode x8", "mixed 4 + 64", "prefill 2 x 64"]


def test_moe_row_overhead_recovers_the_constants_the_cells_were_made_with():
    """Cells made as the model's layer with a fixed time a and a per-row cost c outside its kernels (the kernels
    measured as the model prices them) give back a and c, and ranges that are a and c; cells faster than the model
    give 0, never below."""
    cfg, sp, k = serving_model(), get("tpu7x-8"), serving_model().num_experts_per_tok
    a, c = 4e-5, 3e-8
    mech = Mechanisms.nominal(moe_row_overhead_s=0.0, moe_layer_fixed_s=0.0)
    cells = {}
    for n in (64, 256, 1024, 4096):
        lt = layer_time(cfg, sp, n, mech)
        cells[n] = (lt.seconds + a + c * n * k, lt.breakdown["routed_experts"])
    got = validate.moe_row_overhead(cells)
    assert got["cells"] == [64, 256, 1024]  # the larger cell judges, it does not set
    for fit, want in ((got, c), (got["fixed"], a)):
        assert fit["value"] == pytest.approx(want, rel=1e-6)
        assert fit["low"] == pytest.approx(want, rel=1e-6) and fit["high"] == pytest.approx(want, rel=1e-6)
    faster = validate.moe_row_overhead({n: (g + 0.5 * (t - a - c * n * k - g), g) for n, (t, g) in cells.items()})
    assert faster["value"] == 0.0 and faster["fixed"]["value"] == 0.0 and faster["low"] == 0.0  # never below 0


def test_moe_layer_comparison_roles_and_ratios():
    rows = validate.moe_layer_comparison()
    cells = validate.moe_measured()["cells_us"]
    assert [r["tokens"] for r in rows] == sorted(int(n) for n in cells)
    for r in rows:
        assert r["measured_us"] == pytest.approx(cells[str(r["tokens"])])
        assert r["ratio"] == pytest.approx(r["model_us"] / r["measured_us"])
        assert r["within_25pct"] == (abs(r["ratio"] - 1) <= 0.25)
        assert r["role"] == ("sets moe_row_overhead_s, moe_layer_fixed_s" if r["tokens"] <= validate.MOE_SET_FROM
                             else "judges")
        assert r["kernel_us"] == pytest.approx(validate.moe_measured()["kernel_us"][str(r["tokens"])])
        assert r["outside_ratio"] == pytest.approx((r["model_us"] - r["model_kernel_us"]) / (r["measured_us"] -
                                                                                          r["kernel_us"]))
        assert sum(r["breakdown_us"].values()) == pytest.approx(r["model_us"], rel=1e-6)


def test_published_comparison_predicts_each_compared_row_under_its_setup(monkeypatch):
    predict_mod = sys.modules["qwen35_lib.costmodel.predict"]  # the module (the package's `predict` is the function)
    seen = []

    def fake(model, hw, stage, isl, osl, conc, **kw):
        seen.append((stage, isl, conc, kw))
        out = dict(total_tokens_per_s=1000.0 * conc, median_tpot_s=0.05, median_ttft_s=1.5)
        if kw["band"]:
            out["band"] = dict(total_tokens_per_s=(0.0, 1e9), median_tpot_s=(0.0, 1e-6))
        return out

    monkeypatch.setattr(predict_mod, "predict", fake)
    rows = validate.published_comparison(("kernels", M), band=True)
    compared = [m for m in validate.published()["measurements"] if m.get("compare")]
    assert len(rows) == len(compared) and len(seen) == 2 * len(compared)
    for row, m in zip(rows, compared):
        assert row[f"ratio_{M}"] == pytest.approx(1000.0 * m["concurrency"] / m["total_tokens_per_s"])
        assert row["predicted_median_tpot_ms_kernels"] == pytest.approx(50.0)
        assert row[f"predicted_median_ttft_ms_{M}"] == pytest.approx(1500.0)
        assert (f"ttft_ratio_{M}" in row) == bool(m.get("median_ttft_ms"))  # a ratio only where one is published
        assert row["inside_band"] and "band_total_tokens_per_s" in row  # the band: the measured stage only
        assert row.get("tpot_inside_band") in (None, False)  # a TPOT band of [0, 1e-3 ms] holds no measurement
    for stage, _, _, kw in seen:
        assert kw["band"] == (stage == M) and kw["roofline"] is False
    assert seen[0][3]["kv_dtype"] == compared[0]["setup"].get("kv_dtype", "float8_e4m3fn")


def test_acceptance_figures_of_hand_made_rows():
    rows = [dict(acceptance=True, concurrency=c, **{f"ratio_{M}": r, f"tpot_ratio_{M}": t}, inside_band=True,
                 tpot_inside_band=True) for c, r, t in ((64, 1.0, 1.1), (128, 0.9, 1.0), (256, 1.1, 0.8))]
    rows.append(dict(acceptance=False, concurrency=512, **{f"ratio_{M}": 5.0}))
    got = validate.acceptance(rows)
    assert [p["concurrency"] for p in got["points"]] == [64, 128, 256]
    assert got["trend"] == pytest.approx(0.1) and got["trend_ok"]
    assert got["all_within_25pct"] and got["all_inside_band"]
    rows[2][f"tpot_ratio_{M}"] = 0.7  # 30 % off
    rows[0]["inside_band"] = False
    got = validate.acceptance(rows)
    assert not got["all_within_25pct"] and not got["all_inside_band"]
    assert [p["tpot_within_25pct"] for p in got["points"]] == [True, True, False]


def test_published_low_concurrency_layouts_within_25_percent():
    """Issue 55's acceptance: tpu-inference's low-concurrency rows (#3050's DP4TP2_EP at c4-c32, #3116's TP8_EP at
    c4-c8, 8k/1k and 1k/1k), each priced as that engine runs its layout: total tokens/s and median TPOT (where
    published) within 25%."""
    rows = validate.layout_points()
    assert len(rows) == 11
    assert all(r["within_25pct"] and r.get("tpot_within_25pct", True) for r in rows), [
        (r["layout"], r["isl"], r["concurrency"], round(r["ratio"], 2), round(r.get("tpot_ratio", 0), 2)) for r in rows]


def test_band_drivers_name_what_holds_the_band_open():
    """`validate.band_drivers` (issue 55): per #3050 acceptance point, the band's width and each swept assumption's
    own spread, largest first; the corners' ratios bracket the nominal."""
    from qwen35_lib.costmodel import validate as v

    rows = v.band_drivers()
    assert [r["concurrency"] for r in rows] == [64, 128, 256]
    for r in rows:
        spreads = list(r["by_assumption"].values())
        assert spreads == sorted(spreads, reverse=True) and all(x >= 1 for x in spreads)
        assert r["high_over_low"] >= spreads[0]
        assert r["corners"]["pessimistic"] < 1 < r["corners"]["optimistic"]


def test_ttft_points_predict_each_published_ttft_row_under_its_setup(monkeypatch):
    """`validate.ttft_points` (issue 55): every row that publishes a median TTFT, predicted under its own setup (its
    async scheduling and DP batch-prefill switches reach the mechanisms), the ratios predicted / published."""
    predict_mod = sys.modules["qwen35_lib.costmodel.predict"]
    seen = []

    def fake(model, hw, stage, isl, osl, conc, **kw):
        seen.append((stage, isl, kw))
        return dict(total_tokens_per_s=1000.0, median_tpot_s=0.02, median_ttft_s=2.0, mean_step_s=0.03)

    monkeypatch.setattr(predict_mod, "predict", fake)
    rows = validate.ttft_points()
    published = [m for m in validate.published()["measurements"] if m.get("ttft")]
    assert len(rows) == len(published) >= 2 and all(m["median_ttft_ms"] > 0 for m in published)
    for row, m, (stage, isl, kw) in zip(rows, published, seen):
        assert stage == M and isl == m["isl"] and kw["num_prompts"] == m["setup"]["num_prompts"]
        assert kw["mechanisms"].async_scheduling == m["setup"]["async_scheduling"]
        assert kw["mechanisms"].dp_batch_prefill == m["setup"]["dp_sched_batch_prefill"]
        assert row["median_ttft_ms_ratio"] == pytest.approx(2000.0 / m["median_ttft_ms"])
        assert row["median_tpot_ms_ratio"] == pytest.approx(20.0 / m["median_tpot_ms"])
        assert row["total_tokens_per_s_within_25pct"] == (abs(1000.0 / m["total_tokens_per_s"] - 1) <= 0.25)
    assert validate.setup_mechanisms({"async_scheduling": False}).async_scheduling is False
