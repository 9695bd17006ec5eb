"""qwen35_lib.budget: the HBM budget's fit boundary, and its weight bytes per device against the resident-bytes
reference and the TPU7x compile's."""

from __future__ import annotations

import pytest

from qwen35_lib import budget
from qwen35_lib.config import get_config
from tests import aot_subprocess


def test_max_concurrency_is_the_fit_boundary():
    fp8 = get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn", gdn_state_dtype="bfloat16")
    n = budget.hbm_budget(fp8, "tpu7x-8", 1, 8192).max_concurrency
    assert budget.hbm_budget(fp8, "tpu7x-8", n, 8192).fits
    assert not budget.hbm_budget(fp8, "tpu7x-8", n + 1, 8192).fits


@pytest.mark.parametrize("model", ["qwen3.5-397b-a17b", "qwen3.5-tiny"])
def test_experts_sharded_weight_bytes_are_the_references(model):
    """The budget's `experts_sharded` weights a device (the routed experts split, the rest whole) are the resident-bytes
    reference's (`costmodel.traffic.weight_bytes`) for the plan it names (`SPREAD_PLANS`), bound to that many
    devices."""
    from qwen35_lib.costmodel import traffic
    from qwen35_lib.plan import abstract_mesh

    for expert_dtype in (None, "float8_e4m3fn"):
        cfg = get_config(model, expert_dtype=expert_dtype)
        for devices in (2, 8):
            plan = budget.SPREAD_PLANS["experts_sharded"].bind(abstract_mesh(devices), cfg)
            assert budget.weight_bytes_per_device(cfg, devices, "experts_sharded") == traffic.weight_bytes(plan, cfg)


def _compiled_weight_bytes(spread: str, expert_dtype: str | None) -> dict:  # in aot_subprocess's child
    import dataclasses

    config = get_config("qwen3.5-397b-a17b", expert_dtype=expert_dtype)
    return dataclasses.asdict(budget.compiled_weight_bytes(config, spread))


@pytest.mark.tpu_compile
def test_compiled_weight_bytes_match_the_budget():
    """XLA, compiling for tpu7x:2x2x1, puts as many weight bytes on each device as the budget predicts."""
    fp8 = get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn")
    jobs = {p: (_compiled_weight_bytes, p, "float8_e4m3fn") for p in budget.WEIGHT_SPREADS}
    compiled = aot_subprocess.run(jobs | {"refused": (_compiled_weight_bytes, "experts_sharded", None)})
    for spread in budget.WEIGHT_SPREADS:
        r = compiled[spread]
        assert r["error"] is None, r
        predicted = budget.weight_bytes_per_device(fp8, 8, spread)
        assert abs(r["argument_bytes_per_device"] - predicted) <= 1e-3 * predicted, (spread, r, predicted)
    refused = compiled["refused"]
    assert refused["argument_bytes_per_device"] is None and "RESOURCE_EXHAUSTED" in refused["error"]
