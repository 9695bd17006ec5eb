"""The CPU micro-benchmarks: the median of timed runs after a warm-up (on a fake clock), and a real measurement
returning every figure `specs` describes, positive and cached (no timed assertion: figures vary by machine)."""

from __future__ import annotations

import math

from qwen35_lib.costmodel import cpu_bench


class _Ready:
    def block_until_ready(self):
        return self


def test_median_time_warms_up_then_takes_the_median(monkeypatch):
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # runs of 1, 3 and 2 seconds
    monkeypatch.setattr(cpu_bench.time, "perf_counter", lambda: next(ticks))
    runs = []
    assert cpu_bench.median_time(lambda x: runs.append(x) or _Ready(), 7, repeats=3) == 2.0
    assert runs == [7] * 4  # one warm-up (untimed), three timed


def test_measure_returns_positive_figures_for_every_described_spec():
    m = cpu_bench.measure(1)
    tables = {"dense_rows_flops": cpu_bench.DENSE_ROWS}
    assert set(m) == {"matmul_flops", "memory_bytes_per_s", "op_overhead_s", "copy_bytes_per_s",
                      "small_matmul_flops", "vector_flops", *tables}
    assert all(v > 0 and math.isfinite(v) for k, v in m.items() if k not in tables)
    for key, rows in tables.items():  # (rows, FLOP/s) at every measured row count
        assert tuple(r for r, _ in m[key]) == rows and all(f > 0 and math.isfinite(f) for _, f in m[key])
    assert cpu_bench.measure(1) is m  # cached per process
    assert {"op_overhead_s", "copy_bytes_per_s", "small_matmul_flops", "vector_flops", *tables} <= \
        set(cpu_bench.DESCRIPTIONS)


def test_the_median_of_several_measurements_is_taken_figure_by_figure():
    a = {"matmul_flops": 3.0, "dense_rows_flops": ((16, 1.0), (32, 6.0))}
    b = {"matmul_flops": 1.0, "dense_rows_flops": ((16, 2.0), (32, 5.0))}
    c = {"matmul_flops": 2.0, "dense_rows_flops": ((16, 3.0), (32, 4.0))}
    assert cpu_bench.median_of([a, b, c]) == {"matmul_flops": 2.0, "dense_rows_flops": ((16, 2.0), (32, 5.0))}
