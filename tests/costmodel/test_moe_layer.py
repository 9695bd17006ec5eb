"""The cost model's MoE layer (`costmodel.moe_layer`, issues 30 and 55) against production's layer as TPU7x
measures it (data/moe_layer_measured.json, judging data): every random-routing cell within 25%, the recorded cells'
time outside the grouped-matmul kernels within 25% on the one-hot path, the two derived constants re-derived from
the cells they were set from, the one-hot threshold switching the permute's form, and the prediction never reading
the measured cells."""

from __future__ import annotations

import json

import pytest

from qwen35_lib import data
from qwen35_lib.costmodel import assumptions, moe_layer, validate
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.predict import serving_model


def test_every_random_routing_cell_within_25_percent():
    """The routing the model's touched-expert count assumes (uniform): the whole layer within 25% at every N."""
    rows = validate.moe_random_routing_comparison()
    assert [r["tokens"] for r in rows] == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert all(r["within_25pct"] for r in rows), [(r["tokens"], round(r["ratio"], 2)) for r in rows]


def test_recorded_cells_outside_the_kernels_within_25_percent_on_the_onehot_path():
    """The recorded cells' time outside the grouped-matmul kernels (what the derived constants describe, whatever
    the routing) within 25% up to 2,048 tokens (one-hot permutes; the two cells above take the SparseCore path)."""
    rows = validate.moe_layer_comparison()
    assert [r["tokens"] for r in rows] == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert {r["role"] for r in rows if r["tokens"] >= 2048} == {"judges"}
    onehot = [r for r in rows if r["tokens"] <= 2048]
    assert all(abs(r["outside_ratio"] - 1) <= 0.25 for r in onehot), [(r["tokens"], round(r["outside_ratio"], 2))
                                                                       for r in onehot]


@pytest.mark.xfail(strict=True, reason="issue 55: the recorded (skewed) routing touches fewer experts than the "
                   "model's uniform count at small N (its grouped matmul x1.36-1.57 of the cells' kernels at N <= 128: "
                   "whole layer x1.35 at 128), and above the one-hot threshold the layer outside its kernels is x0.59 "
                   "at 4,096 (SparseCore path); neither is priced")
def test_every_recorded_cell_within_25_percent():
    rows = validate.moe_layer_comparison()
    assert all(r["within_25pct"] for r in rows), [(r["tokens"], round(r["ratio"], 2)) for r in rows]


def test_the_derived_constants_are_what_their_cells_give():
    """The recorded moe_row_overhead_s and moe_layer_fixed_s are re-derived from the N <= 1,024 cells (and only they
    are derived)."""
    recs = assumptions.records()
    derived = [n for n, r in recs.items() if r["kind"] == "derived"]
    assert derived == list(validate.MOE_DERIVED) == ["moe_row_overhead_s", "moe_layer_fixed_s"]
    got = validate.moe_row_overhead()
    assert got["cells"] == [64, 128, 256, 512, 1024]
    for rec, fit in ((recs["moe_row_overhead_s"], got), (recs["moe_layer_fixed_s"], got["fixed"])):
        for end in ("value", "low", "high"):
            assert rec[end] == pytest.approx(fit[end], rel=0.01), (end, rec[end], fit[end])
    # set from the small cells only: changing a judging cell does not move them
    m = validate.moe_measured()
    cells = {int(n): (us * 1e-6, m["kernel_us"][n] * 1e-6) for n, us in m["cells_us"].items()}
    moved = validate.moe_row_overhead({**cells, 8192: (1.0, 0.5)})
    assert (moved["value"], moved["fixed"]["value"]) == (got["value"], got["fixed"]["value"])


def test_onehot_permute_below_the_threshold_sparsecore_gather_above():
    cfg, sp, mech = serving_model(), specs_lib.get("tpu7x-8"), Mechanisms.nominal()
    k = cfg.num_experts_per_tok
    n_in = mech.onehot_permute_threshold // k  # N·k at the threshold: one-hot
    below, above = (moe_layer.layer_time(cfg, sp, n, mech).breakdown for n in (n_in, n_in + 8))
    D = cfg.hidden_size
    assert below["onehot_permute"] == pytest.approx(4 * k * n_in**2 * D / (sp.peak_flops * sp.eff_matmul), rel=1e-6)
    assert above.get("onehot_permute", 0.0) == 0.0
    # above the threshold the SparseCore moves the N·k-row buffers: that share of them stays on the TensorCore
    full = 2 * (n_in + 8) * k * D * 2 / (sp.hbm_bytes_per_s * sp.eff_hbm)
    assert above["permute"] == pytest.approx(full * mech.sparsecore_permute, rel=1e-3)
    assert below["moe_rows"] == pytest.approx(n_in * k * mech.moe_row_overhead_s + mech.moe_layer_fixed_s)


def test_the_step_model_charges_the_layer_for_the_pallas_stages_only():
    from qwen35_lib.costmodel.ops import Batch
    from qwen35_lib.costmodel.step import step_time
    from qwen35_lib.plan import any_stage

    cfg, sp, mech = serving_model(), specs_lib.get("tpu7x-8"), Mechanisms.nominal()
    b = Batch(prefill_tokens=2048, prefill_seqs=2, max_ctx=1024)
    kern = step_time(cfg, sp, any_stage(validate.MEASURED_STAGE), b, "float8_e4m3fn", mech=mech).breakdown
    xla = step_time(cfg, sp, any_stage("fused_ag"), b, "float8_e4m3fn", mech=mech).breakdown
    assert kern["onehot_permute"] > 0 and kern["moe_rows"] > 0
    assert xla["onehot_permute"] == xla["moe_rows"] == 0  # this project's XLA MoE: its own permute, charged apart


def test_prediction_never_reads_the_measured_cells(monkeypatch):
    real = data.read_json

    def guarded(name):
        assert name not in ("moe_layer_measured.json", "published.json"), f"prediction read {name}"
        return real(name)

    monkeypatch.setattr(data, "read_json", guarded)
    from qwen35_lib import costmodel

    r = costmodel.predict(stage=validate.MEASURED_STAGE, isl=1024, osl=256, concurrency=16, roofline=False)
    assert r["fits"] and r["total_tokens_per_s"] > 0
    moe_layer.layer_time(serving_model(), specs_lib.get("tpu7x-8"), 1024, Mechanisms.nominal())


def test_cli_validate_moe_prints_the_eight_cells(capsys):
    from qwen35_lib.costmodel.__main__ import main

    assert main(["validate", "--moe", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["cells"]) == 8 and doc["moe_row_overhead"]["cells"] == [64, 128, 256, 512, 1024]
    assert main(["validate", "--moe"]) == 0
    text = capsys.readouterr().out
    assert "8/8 cells within 25%" in text and "judges" in text


def test_published_serving_within_25_percent_under_its_own_setup():
    """tpu-inference #3050 (8k/1k at 64, 128, 256 concurrent requests), each point predicted under its recorded
    setup and the plan it ran: total tokens/s and median TPOT within 25%, no trend with concurrency, and every
    published figure inside the printed band."""
    a = validate.acceptance()
    assert a["stage"] == "tpu_inference_3050"
    assert a["all_within_25pct"] and a["trend_ok"] and a["all_inside_band"], a


def test_the_second_shape_is_priced_as_its_arm_ran():
    """Qwen3-30B-A3B's cells (issue 55, item 6) ran production's layer at upstream defaults: no one-hot permute, no
    all-gathers (tokens come in replicated), the combine's all-reduce; the config is the shape's, nothing else."""
    cfg = validate.second_shape_config()
    assert (cfg.hidden_size, cfg.moe_ffn, cfg.num_experts, cfg.num_experts_per_tok) == (2048, 768, 128, 8)
    rows = validate.moe_second_shape_comparison()
    assert [r["tokens"] for r in rows] == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    for r in rows:
        parts = r["breakdown_us"]
        assert "all_gather" not in parts and "reduce_scatter" not in parts and parts["all_reduce"] > 0
        assert "onehot_permute" not in parts
        assert r["model_us"] == pytest.approx(sum(parts.values()))


@pytest.mark.xfail(strict=True, reason="issue 55, item 6, open: 7/8 of the second shape's cells within 25% (it was 2/8 "
                   "before the layer's fixed time outside its kernels was set apart from the per-row cost); the 512 "
                   "cell is x0.60 (the file's own caveat: 234.6 us there against 229.7 at 1,024)")
def test_the_second_shape_within_25_percent():
    rows = validate.moe_second_shape_comparison()
    assert all(r["within_25pct"] for r in rows), [(r["tokens"], round(r["ratio"], 2)) for r in rows]
