"""The cost model's MoE layer (`costmodel.moe_layer`, issue 30) against production's layer as TPU7x measures it
(data/moe_layer_measured.json, judging data): every cell within 25%, the one derived constant re-derived from the
cells it was set from, the one-hot threshold switching the permute's form, and the prediction never reading the
measured cells."""

from __future__ import annotations

import json

import pytest

from qwen35_lib import data
from qwen35_lib.costmodel import assumptions, moe_layer, validate
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.predict import serving_model


def test_every_measured_cell_within_25_percent():
    rows = validate.moe_layer_comparison()
    assert [r["tokens"] for r in rows] == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert all(r["within_25pct"] for r in rows), [(r["tokens"], round(r["ratio"], 2)) for r in rows]
    assert {r["role"] for r in rows if r["tokens"] >= 2048} == {"judges"}


def test_the_derived_constant_is_what_its_cells_give():
    """The recorded moe_row_overhead_s is re-derived from the N <= 1,024 cells (and only it is derived)."""
    recs = assumptions.records()
    derived = [n for n, r in recs.items() if r["kind"] == "derived"]
    assert derived == ["moe_row_overhead_s"]
    got = validate.moe_row_overhead()
    rec = recs["moe_row_overhead_s"]
    assert got["cells"] == [64, 128, 256, 512, 1024]
    assert rec["value"] == pytest.approx(got["value"], rel=0.01)
    assert rec["low"] == pytest.approx(got["low"], abs=1e-10) and rec["high"] == pytest.approx(got["high"], rel=0.01)
    # set from the small cells only: changing a judging cell does not move it
    cells = {int(n): us * 1e-6 for n, us in validate.moe_measured()["cells_us"].items()}
    assert validate.moe_row_overhead({**cells, 8192: 1.0})["value"] == got["value"]


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
    assert below["moe_rows"] == pytest.approx(n_in * k * mech.moe_row_overhead_s)


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


@pytest.mark.xfail(strict=True, reason="issue 55, item 6, open: the 397B layer model does not transfer to the second "
                   "shape (2/8 cells within 25%: x0.51-0.55 at N <= 512, x1.29-1.30 at N >= 4096); no mechanism priced "
                   "from a published figure restates moe_row_overhead_s (see validate.moe_second_shape_comparison)")
def test_the_second_shape_within_25_percent():
    rows = validate.moe_second_shape_comparison()
    assert all(r["within_25pct"] for r in rows), [(r["tokens"], round(r["ratio"], 2)) for r in rows]
