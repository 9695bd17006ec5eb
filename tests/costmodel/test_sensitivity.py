"""The sensitivity sweep: each assumption scaled alone, scale 1 priced once, a gain = kernels / baseline; and the
real ladder's gain above 1."""

from __future__ import annotations

import pytest

from qwen35_lib.costmodel import sensitivity, specs


def test_each_assumption_scales_its_own_fields_only():
    base = specs.get("tpu7x-8")
    ici = sensitivity.ASSUMPTIONS["ICI link bandwidth"](base, 2.0)
    assert ici.ici_link_bytes_per_s == 2 * base.ici_link_bytes_per_s
    assert ici.replace(ici_link_bytes_per_s=base.ici_link_bytes_per_s) == base
    lat = sensitivity.ASSUMPTIONS["collective latency"](base, 0.5)
    assert (lat.hop_latency_s, lat.collective_launch_s) == (base.hop_latency_s / 2, base.collective_launch_s / 2)
    core = sensitivity.ASSUMPTIONS["core-to-core bandwidth"](base, 3.0)
    assert core.core_link_bytes_per_s == 3 * base.core_link_bytes_per_s
    hbm = sensitivity.ASSUMPTIONS["HBM efficiency"]
    assert hbm(base, 0.5).eff_hbm == base.eff_hbm / 2
    assert hbm(base, 100.0).eff_hbm == 1.0  # an efficiency never passes 1


def test_sweep_prices_scale_one_once_and_each_point_as_a_ratio(monkeypatch):
    calls = []

    def fake_predict(model, sp, stage, isl, osl, concurrency, roofline):
        calls.append((sp.ici_link_bytes_per_s, stage, isl))
        speed = {"baseline": 10.0, "kernels": 30.0}[stage] * sp.ici_link_bytes_per_s / base.ici_link_bytes_per_s
        return {"total_tokens_per_s": speed * (2 if stage == "kernels" and isl == 1024 else 1)}

    base = specs.get("tpu7x-8")
    monkeypatch.setattr(sensitivity, "predict", fake_predict)
    out = sensitivity.sweep((0.5, 1.0, 2.0), assumptions=["ICI link bandwidth"])
    assert out == {"ICI link bandwidth": [(0.5, 3.0, 6.0), (1.0, 3.0, 6.0), (2.0, 3.0, 6.0)]}
    assert len(calls) == 4 * 3  # 3 scales x 2 workloads x 2 stages, scale 1 once
    assert sum(c[0] == base.ici_link_bytes_per_s for c in calls) == 4


def test_the_kernels_stage_gains_over_the_baseline():
    assert sensitivity.gain(specs.get("tpu7x-8"), 8192, 1024, concurrency=64) > 1.0


def test_an_unknown_assumption_is_a_key_error(monkeypatch):
    monkeypatch.setattr(sensitivity, "predict", lambda *a, **k: {"total_tokens_per_s": 1.0})
    with pytest.raises(KeyError, match="ICI"):
        sensitivity.sweep((2.0,), assumptions=["ICI"])
