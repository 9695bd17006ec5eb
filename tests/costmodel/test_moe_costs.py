"""costmodel.moe_costs: the capacity kernel's slots, the grouped matmul's touched experts, production's layer
around it."""

from __future__ import annotations

import pytest

from qwen35_lib import get_config
from qwen35_lib.costmodel import moe_costs, ops


def test_capacity_slots_follow_the_kernels_rule():
    assert moe_costs.capacity_slots(64, 64) == 8 and moe_costs.capacity_slots(544, 64) == 24  # moe_capacity's rule


def test_the_grouped_matmul_reads_the_experts_hit_and_ragged_dot_every_one():
    cfg = get_config("qwen3.5-mini", dtype="float32")
    one = ops.Batch(decodes=1)  # one token: k experts hit of E
    w = 3 * cfg.hidden_size * cfg.moe_ffn * 4  # one expert's float32 weights
    pallas = moe_costs.moe_block(cfg, one, ops.Pricing(moe_impl="pallas"))["routed_experts"]
    ragged = moe_costs.moe_block(cfg, one, ops.Pricing(moe_impl="ragged_dot"))["routed_experts"]
    assert pallas.bytes == pytest.approx(cfg.num_experts_per_tok * w, rel=0.01)
    assert ragged.bytes == pytest.approx(cfg.num_experts * w, rel=0.01)


def test_the_layer_around_the_grouped_matmul():
    cfg = get_config("qwen3.5-mini")
    few = moe_costs.layer_costs(cfg, 8, onehot_threshold=1024, row_overhead_s=1e-9, fixed_s=5e-5)
    many = moe_costs.layer_costs(cfg, 4096, onehot_threshold=1024, row_overhead_s=1e-9, fixed_s=5e-5)
    assert few["onehot_permute"].mxu_flops > 0 and many["onehot_permute"].mxu_flops == 0  # one-hot below the threshold
    assert many["moe_rows"].seconds == pytest.approx(4096 * cfg.num_experts_per_tok * 1e-9 + 5e-5)
