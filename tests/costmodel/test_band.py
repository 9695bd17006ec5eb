"""costmodel.band: the band over the swept assumptions' ends (one at a time and the joint corners), and `explain_of`
on a fake schedule."""

from __future__ import annotations

import dataclasses

import pytest

from qwen35_lib import costmodel
from qwen35_lib.costmodel import assumptions
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.band import explain_of

SMALL = dict(isl=1024, osl=256, concurrency=16, roofline=False)


def test_band_brackets_the_prediction_and_names_each_end():
    r = costmodel.predict(stage="kernels", band=True, **SMALL)
    b = r["band"]
    lo, hi = b["total_tokens_per_s"]
    assert lo <= r["total_tokens_per_s"] <= hi and b["high_over_low"] == pytest.approx(hi / lo)
    swept = [n for n, rec in assumptions.records().items() if rec["kind"] in assumptions.SWEPT
             and n != "host_step_time_sync_s"]  # async scheduling is on: the synchronous host time is not in force
    assert sorted((x["assumption"], x["end"]) for x in b["extremes"]) == sorted(
        (n, e) for n in swept for e in ("low", "high"))
    tpot = {(x["assumption"], x["end"]): x["median_tpot_s"] for x in b["extremes"]}
    assert tpot[("host_step_overhead_s", "high")] > r["median_tpot_s"] > tpot[("host_step_overhead_s", "low")]
    # the joint corners: every swept assumption at its worse (better) end at once, outside every single extreme
    c = {x["corner"]: x for x in b["corners"]}
    singles = [x["total_tokens_per_s"] for x in b["extremes"]]
    assert c["pessimistic"]["total_tokens_per_s"] <= min(singles) and max(singles) <= c["optimistic"][
        "total_tokens_per_s"]
    assert [lo, hi] == [c["pessimistic"]["total_tokens_per_s"], c["optimistic"]["total_tokens_per_s"]]
    assert set(c["pessimistic"]["values"]) == set(swept)


def test_explain_switches_each_applied_mechanism_off_alone():
    """`explain_of`: a mechanism at its neutral value is re-timed (its ratio: the nominal over the rerun); one already
    neutral is not; components sorted by their seconds, each with its assumptions."""
    @dataclasses.dataclass
    class Sim:
        seconds: float
        steps: int
        total_tokens_per_s: float
        breakdown: dict = dataclasses.field(default_factory=dict)

    mech = Mechanisms.nominal()
    reruns = []

    def rerun(m):
        reruns.append(m)
        return Sim(seconds=4.0, steps=2, total_tokens_per_s=50.0)

    e = explain_of(Sim(2.0, 2, 100.0, {"host": 0.5, "gdn_core": 1.5}), mech, rerun)
    assert list(e["components"]) == ["gdn_core", "host"] and e["mean_step_s"] == 1.0
    applied = [k for k, v in e["mechanisms"].items() if v["applied"]]
    assert len(reruns) == len(applied) > 0 and all(m != mech for m in reruns)
    for k in applied:
        m = e["mechanisms"][k]
        assert m["total_tokens_per_s_ratio"] == 2.0 and m["mean_step_s_delta"] == -1.0
        assert m["assumption"] == assumptions.records()[k]
