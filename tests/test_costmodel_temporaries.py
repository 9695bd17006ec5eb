"""The cost model's closed-form temporaries (`costmodel.temporaries`) against the TPU7x compile's `temp_bytes`, from
the stored sweep (`qwen35_lib/data/aot/tpu7x-8.json`, written by `python -m qwen35_lib.aot sweep`): within 25%
for every step the file holds (issue 12, item 6). The estimate never reads the file's numbers: only its shapes."""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh

from qwen35_lib import data
from qwen35_lib.aot import sweep
from qwen35_lib.costmodel import temporaries, traffic
from qwen35_lib.engine.cache import CacheShape
from qwen35_lib.parallel.mesh import AXES
from qwen35_lib.parallel.stages import get_stage, stage_config

DOC = data.read_json("aot/tpu7x-8.json")
MIXED = pytest.mark.xfail(strict=True, reason="the mixed step's MoE row buffers: estimate 4.3 GB, compile 6.65 GB "
                          "(397B kernels, 1,024 prefill tokens a rank; see costmodel.temporaries)")
XLA_DECODE = pytest.mark.xfail(strict=True, reason="the XLA stages' decode step: estimate 11.0 GB, compile 16.6-17.0 "
                                "GB (397B, full depth, dp_ep to hier_rs); the compiled loop holds more FP8 and bf16 "
                                "expert copies than the table's one dequantized slice a group, not yet attributed")


def _marks(stage: str, step: str) -> list:
    if get_stage(stage).kernels != "pallas":
        return [XLA_DECODE] if step.endswith("decode") else []
    return [MIXED] if step.endswith("mixed") else []


CASES = [pytest.param(stage, step, marks=_marks(stage, step))
         for stage, s in DOC["stages"].items() for step, e in s["steps"].items()
         if "temp_bytes" in e and "same_program_as" not in e]


def _estimate(stage: str, entry: dict) -> dict:
    shape = DOC["shape"]
    plan = get_stage(stage).bind(AbstractMesh((4, 2), AXES))  # tpu7x:2x2x1: 4 chips x 2 cores
    cfg = stage_config(sweep.serving_config(DOC["model"], DOC["groups"], **DOC["overrides"]), stage, "tpu")
    R = entry["ranks"]
    S = -(-shape["requests"] // R)
    step = traffic.StepShape.of_compile(cfg, R, shape["requests"], entry["decode_tokens_per_rank"],
                                        entry["prefill_tokens_per_rank"])
    cache = CacheShape(ranks=R, num_pages=S * -(-shape["context_len"] // shape["page_size"]) + 1,
                       page_size=shape["page_size"], num_slots=S + 1, kv_dtype=shape["kv_dtype"])
    return temporaries.step_temporaries(plan, cfg, step, cache)


def test_the_stored_sweep_holds_compiled_steps_to_judge_against():
    assert DOC.get("weight_layouts") == "mxu" and CASES, (DOC.get("weight_layouts"), CASES)


@pytest.mark.parametrize("stage, step", CASES)
def test_the_estimate_is_within_25_percent_of_the_compile(stage, step):
    entry = DOC["stages"][stage]["steps"][step]
    est = _estimate(stage, entry)
    assert est["total"] == pytest.approx(entry["temp_bytes"], rel=0.25), (est, entry["temp_bytes"])


def test_in_place_experts_are_not_charged_and_copied_ones_are():
    entry = next(e for s in DOC["stages"].values() for e in s["steps"].values())
    pallas = _estimate("kernels", entry)["weight_slices"]
    xla = _estimate("hier_rs", entry)["weight_slices"]  # the XLA MoE: each group's FP8 experts copied + bf16
    assert xla > pallas + 1e9, (xla, pallas)
