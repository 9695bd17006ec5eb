"""costmodel.fused_combine: the fused EP stage's combine priced by hand (rows, wire, overlap), its collectives and
permute against the kernels stage's, and the step's MoE time as the larger of the matmul and the combine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qwen35_lib import get_config
from qwen35_lib.costmodel import collectives as cc
from qwen35_lib.costmodel import fused_combine, ops, step, traffic
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.plan import abstract_mesh, any_stage, get_stage

CFG = get_config("qwen3.5-397b-a17b")
TPU = specs_lib.get("tpu7x-8")


def test_the_combine_is_an_all_to_all_of_each_devices_routed_rows_every_layer():
    # 1,030 tokens padded to 1,032 over 8 devices, 10 copies each: 1,290 rows of 4,096 bf16 a device and layer
    one = cc.all_to_all(TPU, 1032 * 10 * 4096 * 2 / 8, 8)
    got = fused_combine.combine_comm(CFG, TPU, 1030)
    assert got.seconds == pytest.approx(one.seconds * CFG.num_layers)
    assert got.wire_bytes == pytest.approx(1032 * 10 * 4096 * 2 / 8 * 7 / 8 * CFG.num_layers)


def test_exposed_is_the_combine_beyond_the_matmul_it_hides_behind():
    full, half = Mechanisms.nominal(fused_combine_overlap=1.0), Mechanisms.nominal(fused_combine_overlap=0.5)
    assert fused_combine.exposed(3.0, 5.0, full) == 0.0  # hidden whole behind a longer matmul
    assert fused_combine.exposed(5.0, 3.0, full) == 2.0  # max(matmul, combine) - matmul
    assert fused_combine.exposed(5.0, 3.0, half) == pytest.approx(3.5)
    assert fused_combine.exposed(5.0, 3.0, None) == 5.0  # the model without mechanisms: serial
    np.testing.assert_allclose(fused_combine.exposed(np.array([3.0, 5.0]), np.array([5.0, 3.0]), full), [0.0, 2.0])


def test_the_fused_stage_has_no_reduce_scatter_and_moves_its_rows_once():
    fused, kernels = (any_stage(s).bind(abstract_mesh(8), CFG, platform="tpu") for s in ("fused_ep", "kernels"))
    ops_f, ops_k = (traffic.moe_layer_ops(p, CFG, 1032) for p in (fused, kernels))
    assert [o.kind for o in ops_f] == ["all-gather", "all-gather"]  # hidden states, packed routing
    assert ops_f == [o for o in ops_k if o.kind == "all-gather"]
    assert fused_combine.permute_passes(CFG, 8) == pytest.approx(1.1 / 8)  # recv read, output written


def test_the_step_charges_the_exposed_combine_to_all_to_all_and_nothing_to_reduce_scatter():
    batch = ops.Batch(decodes=64, decode_ctx=4000, prefill_tokens=8 * 1024, prefill_seqs=8, max_ctx=9000)
    mech = Mechanisms.nominal()
    f = step.step_time(CFG, TPU, any_stage("fused_ep"), batch, mech=mech)
    k = step.step_time(CFG, TPU, get_stage("kernels"), batch, mech=mech)
    assert f.breakdown["reduce_scatter"] == 0 and k.breakdown["all_to_all"] == 0
    c = fused_combine.combine_comm(CFG, TPU, batch.computed).seconds
    assert f.breakdown["all_to_all"] == pytest.approx(max(c - f.breakdown["routed_experts"], 0.0))
    assert f.breakdown["routed_experts"] == k.breakdown["routed_experts"]
    # the step_times path (the schedule's) prices the same
    secs, parts = step.step_times(CFG, TPU, any_stage("fused_ep"), [batch], mech=mech)
    assert secs[0] == pytest.approx(f.seconds) and parts["all_to_all"][0] == pytest.approx(f.breakdown["all_to_all"])
    serial = dataclasses.replace(mech, fused_combine_overlap=0.0)
    assert step.step_time(CFG, TPU, any_stage("fused_ep"), batch, mech=serial).breakdown["all_to_all"] == \
        pytest.approx(c)
