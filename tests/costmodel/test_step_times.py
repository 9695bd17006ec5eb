"""`step.step_times` and `step.retimed_many` (a schedule's steps at once) give step_time's and retimed's floats."""

import dataclasses

import pytest

from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms, extremes
from qwen35_lib.costmodel.ops import Batch
from qwen35_lib.costmodel.predict import serving_model
from qwen35_lib.costmodel.step import Pools, retimed, retimed_many, step_time, step_times
from qwen35_lib.plan import any_stage

BATCHES = (Batch(decodes=512, decode_ctx=4000, max_ctx=9000, padded_tokens=512, logit_rows=512),
           Batch(decodes=256, decode_ctx=3000, prefill_tokens=4096, prefill_seqs=4, prefill_ctx=1000, max_ctx=9000),
           Batch(prefill_tokens=8192, prefill_seqs=8, prefill_ctx=2048, max_ctx=9000),
           Batch(decodes=8, decode_ctx=100, max_ctx=200, padded_tokens=128))


@pytest.mark.parametrize("stage", ["baseline", "fused_ag", "kernels"])
def test_step_times_are_step_time_exactly(stage):
    cfg, sp, st = serving_model(), specs_lib.get("tpu7x-8"), any_stage(stage)
    nom, pools = Mechanisms.nominal(), Pools(kv=1e8, gdn=2e7)
    for mech, ideal in [(None, False), (None, True), (nom, False)] + [(m, False) for _, _, m in extremes(nom)]:
        secs, parts = step_times(cfg, sp, st, BATCHES, "float8_e4m3fn", mech=mech, ideal=ideal, pools=pools)
        for i, b in enumerate(BATCHES):
            one = step_time(cfg, sp, st, b, "float8_e4m3fn", mech=mech, ideal=ideal, pools=pools)
            assert secs[i] == one.seconds and {k: v[i] for k, v in parts.items()} == one.breakdown, (mech, b)
            assert list(parts) == list(one.breakdown)


def test_retimed_many_is_retimed_exactly():
    cfg, sp, st, nom = serving_model(), specs_lib.get("tpu7x-8"), any_stage("kernels"), Mechanisms.nominal()
    _, base = step_times(cfg, sp, st, BATCHES, "float8_e4m3fn", mech=nom)
    for _, _, m in extremes(nom) + [("off", "", dataclasses.replace(nom, attention_kernel_efficiency=None))]:
        many = retimed_many(cfg, sp, st, BATCHES, base, nom, m)
        each = [retimed(cfg, sp, st, b, {k: float(v[i]) for k, v in base.items()}, nom, m)
                for i, b in enumerate(BATCHES)]
        if many is None:
            assert all(e is None for e in each)
            continue
        for i, e in enumerate(each):
            assert {k: v[i] for k, v in many.items()} == e, (m, i)
