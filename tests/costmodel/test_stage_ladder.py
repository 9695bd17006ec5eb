"""costmodel.stage_ladder: the ladder's rows carry their ratios to `google_baseline`."""

from __future__ import annotations

import pytest

from qwen35_lib import costmodel


def test_ladder_reports_ratios_against_google_baseline():
    rows = costmodel.ladder(workloads=((1024, 256),), concurrency=16, stages=("baseline", "kernels"),
                            mechanisms="off", roofline=False)
    g = costmodel.predict(stage="google_baseline", isl=1024, osl=256, concurrency=16, mechanisms="off",
                          roofline=False)
    assert g["layout"] == "tp8_kvrep" and g["kernels"] == "pallas"
    for r in rows:
        assert r["vs_google_baseline"] == pytest.approx(r["total_tokens_per_s"] / g["total_tokens_per_s"])
