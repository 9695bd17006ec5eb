"""The stored TPU7x-8 compiles of the low-concurrency layouts (`data/aot/tpu7x-8-layouts.json`, issue 55: tp8_ep8's
decode and mixed steps at the 397B widths, 1 layer group, 32 requests) against the cost model's closed form
(`costmodel.traffic`): every collective kind the compile runs, its count and bytes, equal the model's; the model has
no kind the compile lacks. The record is written by `python -m qwen35_lib.aot sweep --stages tp8_ep8 --groups 1
--requests 32`; the model's side is re-derived from today's code."""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh

from qwen35_lib import data
from qwen35_lib.aot.sweep import serving_config
from qwen35_lib.costmodel import traffic
from qwen35_lib.plan import AXES, any_stage

DOC = data.read_json("aot/tpu7x-8-layouts.json")
ENTRIES = [(stage, step) for stage, s in DOC["stages"].items() for step, e in s["steps"].items()
           if e.get("collectives") and not e.get("same_program_as")]


def test_tp8_ep8_decode_and_mixed_are_recorded():
    assert {("tp8_ep8", "8k/1k decode"), ("tp8_ep8", "8k/1k mixed")} <= set(ENTRIES)
    assert DOC["stages"]["tp8_ep8"]["steps"]["8k/1k decode"]["fits"]


@pytest.mark.parametrize("stage, step", ENTRIES)
def test_compiled_collectives_are_the_models(stage, step):
    entry = DOC["stages"][stage]["steps"][step]
    cfg = serving_config(DOC["model"], DOC["groups"], **DOC.get("overrides", {}))
    plan = any_stage(stage).bind(AbstractMesh((4, 2), AXES))  # tpu7x:2x2x1's (chip, core), no libtpu needed
    shape = traffic.StepShape.of_compile(cfg, plan.dp, DOC["shape"]["requests"], entry["decode_tokens_per_rank"],
                                         entry["prefill_tokens_per_rank"])
    want = {k: v for k, v in traffic.collective_counts(plan, cfg, shape, backend="tpu").items() if v[0]}
    got = {k: v for k, v in entry["collectives"].items() if v["count"]}
    assert set(got) == set(want), (sorted(got), sorted(want))
    for kind, (count, nbytes) in want.items():
        assert got[kind]["count"] == count and got[kind]["bytes"] == pytest.approx(nbytes, rel=0.01), kind
