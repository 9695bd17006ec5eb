"""The stored TPU7x-8 compile of the fused_ep stage beside the ladder (`data/aot/tpu7x-8-beyond.json`, issue 50
item 4: the kernels stage with the MoE's dispatch and combine in the grouped-matmul kernel, `kernels.moe.fused_ep`),
at full 397B depth and the ladder sweep's serving shape, judged as every ladder stage is: it fits, its collectives are
the cost model's closed form, no cache pool is copied, its decode FLOPs and bytes are the model's. Kept apart from
tpu7x-8.json (the ladder's record, which chapters 01-06 read whole). Written by `python -m qwen35_lib.aot sweep
--stages fused_ep --json ... --hlo-dir ...` resumed from a copy of tpu7x-8.json; its texts in data/aot/hlo/."""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh

from qwen35_lib import data
from qwen35_lib.aot.sweep import serving_config
from qwen35_lib.costmodel import compiled, traffic
from qwen35_lib.plan import AXES, any_stage

DOC = data.read_json("aot/tpu7x-8-beyond.json")
LADDER_DOC = data.read_json("aot/tpu7x-8.json")
STEPS = ("8k/1k decode", "8k/1k mixed", "1k/8k decode", "1k/8k mixed")


def test_compiled_as_the_ladder_sweep_compiles_its_stages():
    same = ("model", "groups", "overrides", "topology", "jax", "libtpu", "xla_flags", "weight_layouts", "shape",
            "usable_bytes")
    assert {k: DOC[k] for k in same} == {k: LADDER_DOC[k] for k in same}
    assert set(DOC["stages"]) == {"fused_ep"} and set(DOC["stages"]["fused_ep"]["steps"]) == set(STEPS)


@pytest.mark.parametrize("step", STEPS)
def test_fits_with_at_least_the_kernels_stage_headroom_and_copies_no_cache_pool(step):
    e, k = DOC["stages"]["fused_ep"]["steps"][step], LADDER_DOC["stages"]["kernels"]["steps"][step]
    assert e["fits"] and e["headroom_bytes"] >= k["headroom_bytes"], (e["headroom_bytes"], k["headroom_bytes"])
    assert e["cache_pool_copies"] == 0


@pytest.mark.parametrize("step", STEPS)
def test_compiled_collectives_are_the_models_and_hold_no_reduce_scatter(step):
    entry = DOC["stages"]["fused_ep"]["steps"][step]
    cfg = serving_config(DOC["model"], DOC["groups"], **DOC.get("overrides", {}))
    plan = any_stage("fused_ep").bind(AbstractMesh((4, 2), AXES))  # tpu7x:2x2x1's (chip, core)
    shape = traffic.StepShape.of_compile(cfg, plan.dp, DOC["shape"]["requests"], entry["decode_tokens_per_rank"],
                                         entry["prefill_tokens_per_rank"])
    want = {k: v for k, v in traffic.collective_counts(plan, cfg, shape, backend="tpu").items() if v[0]}
    got = {k: v for k, v in entry["collectives"].items() if v["count"]}
    assert set(got) == set(want) == {"all-gather", "all-reduce"}, (sorted(got), sorted(want))
    for kind, (count, nbytes) in want.items():
        assert got[kind]["count"] == count and got[kind]["bytes"] == pytest.approx(nbytes, rel=0.01), kind


@pytest.fixture(scope="module")
def decode():
    return {r["stage"]: r for r in compiled.compare(DOC) if r["step"] == "decode"}["fused_ep"]


def test_decode_flops_and_bytes_are_the_models(decode):
    assert decode["flops_ratio"] == pytest.approx(1.0, abs=0.05), compiled.table([decode])
    assert abs(decode["bytes_ratio"] - 1) <= compiled.DECODE_BYTES_TOLERANCE, compiled.table([decode])
    assert decode["mosaic_bytes"] > 0 and "routed_experts" in decode["without"]


def test_the_fused_layer_leaves_xla_fewer_moe_bytes_than_the_kernels_stage(decode):
    # around the Mosaic calls: the kernels stage's sorted copy of the rows, its combine's partial sums and their
    # reduce-scatter are gone; what is left of the MoE block is the all-gathers and the received copies' weighing
    shape = LADDER_DOC["shape"]
    kernels = compiled.text_side(compiled.stored_text("kernels", "8k/1k decode"), shape["context_len"],
                                 shape["page_size"])
    assert decode["text_bytes_by_block"]["moe"] < kernels["bytes_by_block"]["moe"] / 2
    assert decode["text_bytes"] < kernels["bytes"]
