"""costmodel.play: the closed-form queue wait against every request's wait, and the inter-token latencies by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qwen35_lib.costmodel import play


@pytest.mark.parametrize("clients, cap, prompts", [(1, 1, 1), (64, 64, 640), (640, 64, 6400), (100, 3, 7),
                                                   (5, 200, 64)])
def test_median_queue_wait_is_the_median_of_every_requests_wait(clients, cap, prompts):
    """The closed form (bounded at any concurrency) against the median over every request's wait."""
    first = np.maximum(np.arange(min(clients, prompts)) - cap, 0)
    later = np.full(prompts - first.size, max(clients - cap - 1, 0))
    assert play.median_queue_wait(clients, cap, prompts, 2.0) == float(np.median(np.concatenate([first, later]))) / 2.0


def test_inter_token_latency_counts_each_decoded_token_at_its_steps_time():
    """`itl`: one gap a decoded token, its step's time (steps of 1 s x 1 decode, 2 s x 3, 10 s x 1: gaps
    1, 2, 2, 2, 10); NaN when nothing decodes."""
    med, p99 = play.itl(np.array([1.0, 2.0, 10.0]), np.array([1.0, 3.0, 1.0]))
    assert (med, p99) == (2.0, 10.0)
    assert all(math.isnan(x) for x in play.itl(np.array([1.0]), np.array([0.0])))
