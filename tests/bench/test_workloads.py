"""bench.workloads: the three workloads and their convention, and drawn lengths in range and seeded."""

import math

import pytest

from qwen35_lib.bench import workloads as wl


def test_workloads_file_has_the_three_workloads_and_the_convention():
    loads = wl.load()
    assert {n: (w.input_len, w.output_len) for n, w in loads.items()} == {
        "8k/1k": (8192, 1024), "1k/8k": (1024, 8192), "1k/1k": (1024, 1024)}
    assert all(w.range_ratio == 0.8 for w in loads.values())
    assert wl.parse_factor(wl.cpu_scale()) == wl.parse_factor("1/16")
    w = wl.scaled("8k/1k", "1/16")
    assert (w.input_len, w.output_len, w.scale) == (512, 64, "1/16")
    assert (wl.scaled("1k/8k", 1 / 16).input_len, wl.scaled("1k/8k", 1 / 16).output_len) == (64, 512)
    for bad in ("0", "2", "x", "1/0"):
        with pytest.raises(ValueError):
            wl.parse_factor(bad)
    with pytest.raises(ValueError, match="unknown workload"):
        wl.scaled("2k/2k", 1)


@pytest.mark.parametrize("name", ["8k/1k", "1k/8k", "1k/1k"])
def test_drawn_lengths_lie_in_the_range_and_are_seeded(name):
    w = wl.scaled(name, "1/16")
    requests = wl.draw_requests(w, 200, seed=3, vocab_size=4096)
    ins = [len(p) for p, _ in requests]
    outs = [o for _, o in requests]
    for lengths, L in ((ins, w.input_len), (outs, w.output_len)):
        assert 0.8 * L <= min(lengths) and max(lengths) <= L
        assert len(set(lengths)) > 1  # drawn, not constant
    assert all(2 <= t < 4096 for p, _ in requests for t in p)
    assert requests == wl.draw_requests(w, 200, seed=3, vocab_size=4096)
    assert requests != wl.draw_requests(w, 200, seed=4, vocab_size=4096)
    assert w.bounds(64) == (math.ceil(0.8 * 64), 64) == (52, 64)
