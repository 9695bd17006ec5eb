"""bench.timing: `measure` interleaves its cases and keeps the warm-up outputs; the load monitor withholds ratios
when other processes held the cores."""

import numpy as np

from qwen35_lib.bench.timing import BusyMonitor, environment, measure, ratio_text


def test_measure_interleaves_and_keeps_warmup_outputs():
    calls = []
    candidates = {"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}
    timings, outputs = measure(candidates, repeats=3, settle=0)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then rounds in rotated order
    calls.clear()
    measure(candidates, repeats=2, settle=1)
    assert calls == ["a", "b", "a", "a", "b", "b", "b", "b", "a", "a"]  # each timed call right after its twin
    assert outputs == {"a": 1, "b": 2}
    assert len(timings["a"].times) == 3 and timings["a"].median >= 0
    assert {"date", "jax", "backend", "cpu", "cores"} <= set(environment())


def test_busy_monitor_withholds_ratios_when_others_held_the_cores():
    with BusyMonitor() as m:
        np.ones(1000).sum()
    r = m.result()
    assert {"cores", "loadavg_1m_before", "loadavg_1m_after", "cpu_share", "others_cores", "withhold_ratios"} <= set(r)
    m.load_before = m.cores + 1.0
    r = m.result()
    assert "load average before the run" in r["withhold_ratios"]
    assert ratio_text(2.0, r).startswith("withheld (") and ratio_text(2.0, {"withhold_ratios": None}) == "2.00x"
