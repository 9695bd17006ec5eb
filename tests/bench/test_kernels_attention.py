"""The attention side of `bench kernels` at qwen3.5-tiny size: three rows per case whose counts are worked by hand,
the CPU's attention by items and the Pallas kernel (interpret mode here, labelled so) agreeing with the XLA twin,
and rates that are the counts over the median time."""

from __future__ import annotations

import numpy as np
import pytest

from qwen35_lib.bench.kernels_attention import attention_rows


@pytest.fixture(scope="module")
def rows():
    # decodes at contexts 20 and 9, a 12-token prompt from position 0; pages of 8
    return attention_rows("qwen3.5-tiny", {"small": ([20, 9], [(0, 12)])}, page_size=8, repeats=1)


def test_three_rows_with_the_hand_counted_work(rows):
    assert [(r["case"], r["implementation"]) for r in rows] == [("small", "xla"), ("small", "items"),
                                                                    ("small", "pallas")]
    for r in rows:
        assert (r["tokens"], r["sequences"]) == (14, 3)
        assert r["keys_attended"] == 20 + 9 + sum(range(1, 13))  # causal: position p sees p + 1 keys
        assert (r["model"], r["page_size"], r["kv_dtype"]) == ("qwen3.5-tiny", 8, "bfloat16")


def test_rates_are_the_counts_over_the_median(rows):
    xla, items, pallas = rows
    for r in rows:
        sec = r["median_ms"] / 1e3
        assert r["tokens_per_s"] == pytest.approx(14 / sec)
        assert r["useful_gflop_per_s"] == pytest.approx(4 * 4 * 32 * r["keys_attended"] / sec / 1e9)  # 4 Hq d keys
    assert xla["throughput_ratio_vs_xla"] == 1.0
    for r in (items, pallas):
        assert r["throughput_ratio_vs_xla"] == pytest.approx(xla["median_ms"] / r["median_ms"])


def test_items_and_the_pallas_kernel_agree_and_pallas_says_it_was_interpreted(rows):
    xla, items, pallas = rows
    assert xla["max_abs_diff_vs_xla"] == 0.0 and xla["mode"] == items["mode"] == "XLA (cpu)"
    assert np.isfinite(items["max_abs_diff_vs_xla"]) and items["max_abs_diff_vs_xla"] < 2e-2  # bf16 outputs
    assert pallas["mode"].startswith("interpret (CPU: numerics only")
    assert np.isfinite(pallas["max_abs_diff_vs_xla"]) and pallas["max_abs_diff_vs_xla"] < 2e-2  # bf16 outputs
