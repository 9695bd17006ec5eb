"""costmodel.lockstep: the data-parallel ranks played together, the DP scheduler's dispatch, and the priced
schedule's inter-token latencies."""

from __future__ import annotations

import numpy as np
import pytest

from qwen35_lib.costmodel import lockstep, play, schedule
from qwen35_lib.costmodel.ops import Batch


def toy(batch: Batch) -> tuple[float, dict[str, float]]:
    sec = 1e-3 + 1e-6 * batch.computed
    return sec, {"all": sec}


@pytest.mark.parametrize("dispatch", ["rank", "each", "batch"])
def test_lockstep_counts_every_request_and_charges_the_busiest_rank(dispatch):
    ls = lockstep.lockstep(512, 64, 32, 4, 256, 16, 10**6, 64, 0, 0.8, dispatch=dispatch)
    assert len(ls.events) == ls.played * 4 and ls.outputs.sum() == ls.output_tokens
    steps = int(ls.counts.sum())
    # each slice step computes 4 x the busiest rank's padded slot: a power of two, at least the min slot
    slots = np.array([b.computed // 4 for b in ls.batches])
    assert np.all(slots >= 4) and np.all(slots & (slots - 1) == 0)
    r = lockstep.price(ls, play.each_step(toy))
    assert r.steps == steps and r.seconds == pytest.approx(sum(toy(b)[0] * n for b, n in zip(ls.batches, ls.counts)))
    assert 0 < r.median_tpot_s and 0 < r.median_ttft_s
    # the ranks run together: no faster than one rank's own schedule priced the same way
    one = schedule.simulate(play.each_step(toy), 512, 64, 32, 4, 256, 16, 10**6, 64, 0, 0.8)
    assert r.seconds >= 0.99 * one.seconds * ls.input_tokens / one.input_tokens


def test_batched_prefill_dispatch_starts_the_ranks_prefills_together():
    """With DP_SCHED_BATCH_PREFILL new requests wait until 8 of them can go together, so the ranks prefill in
    the same steps: fewer steps carry any prompt work than when each request is routed as it comes."""
    lengths = play.draw_lengths(256, 512, 64)
    F, *_ = lockstep.play_dp(lengths, 8, 8, 512, 4, True)
    assert np.all(F[:, 0, 2] == [i for i, _ in lengths[:8]])  # step 0: one whole prompt on every rank

    def prompt_steps(batch: bool) -> int:
        F, events, outputs, *_ = lockstep.play_dp(lengths, 64, 8, 256, 16, batch)
        assert len(events) == len(lengths) and sum(outputs) == sum(o for _, o in lengths)
        return int((F[..., 2].sum(axis=0) > 0).sum())

    assert prompt_steps(True) < 0.8 * prompt_steps(False)


def test_lockstep_below_one_client_a_rank_leaves_ranks_idle():
    """Concurrency below the DP size (c2 on DP 8): the DP scheduler has 2 clients, so at most 2 requests decode in
    a step (rounding up to a client a rank played 8 and counted 4x the tokens: issue 55's c1 - c4 layout table)."""
    ls = lockstep.lockstep(1024, 64, 2, 8, 1024, 64, 100, num_prompts=20)
    assert ls.decodes / ls.counts.sum() <= 2
    assert ls.decodes / ls.counts.sum() > 1.5  # both clients kept busy


def test_price_gives_the_inter_token_latency_of_its_own_steps():
    """`price`'s median and p99 ITL are times of its own decoding steps (`play.itl` over them)."""
    ls = lockstep.lockstep(512, 64, 32, 4, 256, 16, 10**6, 64, 0, 0.8)
    r = lockstep.price(ls, play.each_step(toy))
    times = [toy(b)[0] for b in ls.batches if b.decodes]
    assert r.median_itl_s in times and min(times) <= r.median_itl_s <= r.p99_itl_s <= max(times)
