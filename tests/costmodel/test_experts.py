"""costmodel.experts: the expected number of distinct experts a batch routes to, against a simulation."""

from __future__ import annotations

import pytest

from qwen35_lib.costmodel import experts


def test_distinct_experts_against_simulation():
    for T, E, k in ((1, 512, 10), (16, 512, 10), (64, 64, 8), (512, 512, 10)):
        expected = experts.expected_distinct(T, E, k)
        simulated = experts.simulate_distinct(T, E, k, trials=100)
        assert expected == pytest.approx(simulated, rel=0.03), (T, E, k)
    assert experts.expected_distinct(1, 512, 10) == pytest.approx(10)
    assert experts.expected_distinct_per_device(10_000, 512, 10, 8) == pytest.approx(64)
