"""costmodel.retime: a step re-priced under mechanisms that only rescale its components equals the step timed again
(one step, and a schedule's steps at once)."""

from __future__ import annotations

import dataclasses

import pytest

from qwen35_lib.costmodel import assumptions
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms, extremes
from qwen35_lib.costmodel.ops import Batch
from qwen35_lib.costmodel.predict import serving_model
from qwen35_lib.costmodel.retime import RESCALED, retimed, retimed_many
from qwen35_lib.costmodel.step import step_time, step_times
from qwen35_lib.plan import any_stage
from tests.costmodel.toy import BATCHES


@pytest.mark.parametrize("name", [n for n in RESCALED if assumptions.records()[n]["kind"] in assumptions.SWEPT])
def test_a_rescaled_band_end_equals_the_step_timed_again(name):
    """The band prices the ends of the RESCALED mechanisms from the nominal breakdown (`retimed`): exactly
    what step_time gives when it times the step again, for decode, mixed and prefill steps of a Pallas and an
    XLA stage, below and above the one-hot threshold."""
    cfg, sp, nom = serving_model(), specs_lib.get("tpu7x-8"), Mechanisms.nominal()
    rec = assumptions.records()[name]
    batches = [Batch(decodes=512, decode_ctx=4000, max_ctx=9000), Batch(decodes=256, decode_ctx=3000,
               prefill_tokens=4096, prefill_seqs=4, prefill_ctx=1000, max_ctx=9000),
               Batch(prefill_tokens=8192, prefill_seqs=8, prefill_ctx=2048, max_ctx=9000)]
    for stage in ("kernels", "fused_ag"):
        st = any_stage(stage)
        for b in batches:
            base = step_time(cfg, sp, st, b, "float8_e4m3fn", mech=nom).breakdown
            for end in ("low", "high"):
                m = dataclasses.replace(nom, **{name: rec[end]})
                fast = retimed(cfg, sp, st, b, base, nom, m)
                full = step_time(cfg, sp, st, b, "float8_e4m3fn", mech=m).breakdown
                assert fast is not None and fast == pytest.approx(full, rel=1e-9, abs=1e-15), (stage, b, end)


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
