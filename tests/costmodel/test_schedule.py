"""costmodel.schedule: the serving simulation against hand-computed runs, its bounded form against playing every
request, the closed-form queue wait, and the data-parallel ranks in lockstep."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from qwen35_lib import costmodel
from qwen35_lib.costmodel import schedule
from qwen35_lib.costmodel.ops import Batch


def test_bounded_simulation_agrees_with_playing_every_request(monkeypatch):
    """Where both run (concurrency 8192: 2048 requests per rank), the bounded estimate is within 1.5 % of
    playing every request (measured: 0.05-0.7 % at 1k/8k)."""
    from qwen35_lib.costmodel import schedule

    args = ("qwen3.5-397b-a17b", "tpu7x-8", "kernels", 1024, 8192, 8192)
    kw = dict(roofline=False, mechanisms="off", num_prompts=2 * 8192, max_seqs=2 * 8192 // 8)
    full = costmodel.predict(*args, **kw)  # one rank for all (the lockstep: below)
    assert full["played_requests_per_rank"] == 2048
    monkeypatch.setattr(schedule, "EXACT_PROMPTS", 512)
    bounded = costmodel.predict(*args, **kw)
    assert bounded["played_requests_per_rank"] < 1000
    for key in ("total_tokens_per_s", "output_tokens_per_s", "mean_step_s", "mean_running_per_rank", "median_tpot_s"):
        assert bounded[key] == pytest.approx(full[key], rel=0.015), key
    assert bounded["steps"] == pytest.approx(full["steps"], rel=0.015)
    # the queue wait is a closed-form model of the waiting line (measured: 3.2 % at 1k/8k, 0.5 % at 8k/1k)
    assert bounded["median_ttft_s"] == pytest.approx(full["median_ttft_s"], rel=0.05)


def linear_step(batch) -> tuple[float, dict[str, float]]:
    """A toy step time: a launch, the tokens computed, the context read."""
    sec = 1e-3 + 1e-6 * batch.computed + 1e-9 * batch.decodes * batch.decode_ctx
    return sec, {"all": sec}


def test_time_to_first_token_and_per_output_token_by_hand():
    """One client, one request of 64 prompt tokens and 5 output tokens, budget 256: the prompt's step samples the
    first token (TTFT = that step); four decode steps follow, each reading the context so far."""
    from qwen35_lib.costmodel.schedule import draw_lengths, each_step, simulate

    r = simulate(each_step(linear_step), 64, 5, 1, 1, 256, 8, 8, num_prompts=1, seed=0)
    ((prompt, output),) = draw_lengths(1, 64, 5, 0)
    assert r.median_ttft_s == pytest.approx(1e-3 + 1e-6 * prompt, rel=1e-9)
    decodes = [1e-3 + 1e-6 + 1e-9 * (prompt + i) for i in range(2, output + 1)]  # the i-th token reads prompt + i
    assert r.median_tpot_s == pytest.approx(sum(decodes) / (output - 1), rel=1e-9)


@pytest.mark.parametrize("budget, max_running", [(256, 12), (8, 10**6)], ids=["memory-bound", "budget-bound"])
def test_more_clients_than_can_run_only_wait(budget, max_running):
    """The claim the bounded simulation rests on: with more clients than `min(max_running, budget + 1)` the
    queue never empties before the last request, so the run is the same with any number of them."""
    from qwen35_lib.costmodel.schedule import each_step, simulate

    cap = min(max_running, budget + 1)
    runs = [simulate(each_step(linear_step), 64, 32, clients, 1, budget, 10**9, max_running, num_prompts=300)
            for clients in (cap + 1, 3 * cap, 300)]
    same = [dataclasses.replace(r, median_ttft_s=0.0) for r in runs]  # waiting longer is all they change
    assert same[0] == same[1] == same[2]
    assert runs[0].median_ttft_s < runs[1].median_ttft_s < runs[2].median_ttft_s
    fewer = simulate(each_step(linear_step), 64, 32, cap // 2, 1, budget, 10**9, max_running, num_prompts=300)
    assert fewer.seconds != runs[0].seconds  # (well below the cap, clients matter)


@pytest.mark.parametrize("clients, cap, prompts", [(1, 1, 1), (64, 64, 640), (640, 64, 6400), (100, 3, 7),
                                                   (5, 200, 64)])
def test_median_queue_wait_is_the_median_of_every_requests_wait(clients, cap, prompts):
    """The closed form (bounded at any concurrency) against the median over every request's wait."""
    from qwen35_lib.costmodel.schedule import median_queue_wait

    first = np.maximum(np.arange(min(clients, prompts)) - cap, 0)
    later = np.full(prompts - first.size, max(clients - cap - 1, 0))
    assert median_queue_wait(clients, cap, prompts, 2.0) == float(np.median(np.concatenate([first, later]))) / 2.0


def toy(batch: Batch) -> tuple[float, dict[str, float]]:
    sec = 1e-3 + 1e-6 * batch.computed
    return sec, {"all": sec}


@pytest.mark.parametrize("dispatch", ["rank", "each", "batch"])
def test_lockstep_counts_every_request_and_charges_the_busiest_rank(dispatch):
    ls = schedule.lockstep(512, 64, 32, 4, 256, 16, 10**6, 64, 0, 0.8, dispatch=dispatch)
    assert len(ls.events) == ls.played * 4 and ls.outputs.sum() == ls.output_tokens
    steps = int(ls.counts.sum())
    # each slice step computes 4 x the busiest rank's padded slot: a power of two, at least the min slot
    slots = np.array([b.computed // 4 for b in ls.batches])
    assert np.all(slots >= 4) and np.all(slots & (slots - 1) == 0)
    r = schedule.price(ls, schedule.each_step(toy))
    assert r.steps == steps and r.seconds == pytest.approx(sum(toy(b)[0] * n for b, n in zip(ls.batches, ls.counts)))
    assert 0 < r.median_tpot_s and 0 < r.median_ttft_s
    # the ranks run together: no faster than one rank's own schedule priced the same way
    one = schedule.simulate(schedule.each_step(toy), 512, 64, 32, 4, 256, 16, 10**6, 64, 0, 0.8)
    assert r.seconds >= 0.99 * one.seconds * ls.input_tokens / one.input_tokens


def test_batched_prefill_dispatch_starts_the_ranks_prefills_together():
    """With DP_SCHED_BATCH_PREFILL new requests wait until 8 of them can go together, so the ranks prefill in
    the same steps: fewer steps carry any prompt work than when each request is routed as it comes."""
    lengths = schedule.draw_lengths(256, 512, 64)
    F, *_ = schedule.play_dp(lengths, 8, 8, 512, 4, True)
    assert np.all(F[:, 0, 2] == [i for i, _ in lengths[:8]])  # step 0: one whole prompt on every rank

    def prompt_steps(batch: bool) -> int:
        F, events, outputs, *_ = schedule.play_dp(lengths, 64, 8, 256, 16, batch)
        assert len(events) == len(lengths) and sum(outputs) == sum(o for _, o in lengths)
        return int((F[..., 2].sum(axis=0) > 0).sum())

    assert prompt_steps(True) < 0.8 * prompt_steps(False)


def test_lockstep_below_one_client_a_rank_leaves_ranks_idle():
    """Concurrency below the DP size (c2 on DP 8): the DP scheduler has 2 clients, so at most 2 requests decode in
    a step (rounding up to a client a rank played 8 and counted 4x the tokens: issue 55's c1 - c4 layout table)."""
    from qwen35_lib.costmodel.schedule import lockstep

    ls = lockstep(1024, 64, 2, 8, 1024, 64, 100, num_prompts=20)
    assert ls.decodes / ls.counts.sum() <= 2
    assert ls.decodes / ls.counts.sum() > 1.5  # both clients kept busy


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_a_clients_next_request_waits_for_the_steps_in_flight(lag):
    """The admission lag (issue 55, TTFT): a request sent on its predecessor's last output runs `lag` steps later
    than at once, in the one-rank play and under the DP scheduler alike; a request sent to an idle engine does not
    wait. Client A decodes 50 tokens while client B's three short requests (a one-step prompt, 3 tokens) follow
    one another, so B's second and third each arrive while A keeps steps in flight."""
    lengths = [(4, 50), (4, 3), (4, 3), (4, 3)]
    unit = lambda b: (1.0, {})  # noqa: E731  (times in steps)
    p = schedule._play(unit, lengths, 2, 1, 64, 8, admit_lag=lag)
    later = sorted((f[0], f[1]) for f in p.finished if f[0])  # (arrived, first token) of the requests sent later
    assert [first - arrived for arrived, first in later] == [1 + lag] * 2
    _, events, *_ = schedule.play_dp(lengths, 2, 1, 64, 8, False, admit_lag=lag)
    later = sorted((a, f) for a, f, _ in events if a)
    assert [first - arrived for arrived, first in later] == [1 + lag] * 2
    alone = schedule._play(unit, [(4, 3), (4, 3)], 1, 1, 64, 8, admit_lag=lag)  # one client: the engine idles
    assert [f[1] - f[0] for f in alone.finished] == [1, 1]


def test_admission_lag_is_two_steps_with_async_scheduling_and_one_without():
    """`assumptions.admit_lag`: the steps vLLM's engine core has in flight when it next reads its input queue."""
    from qwen35_lib.costmodel.assumptions import Mechanisms, admit_lag

    assert admit_lag(Mechanisms.nominal()) == 2
    assert admit_lag(Mechanisms.nominal(async_scheduling=False)) == 1
    assert admit_lag(Mechanisms.nominal(request_path_steps=1)) == 3
    assert admit_lag(Mechanisms.off()) == 0


def test_inter_token_latency_counts_each_decoded_token_at_its_steps_time():
    """`_itl`: one gap a decoded token, its step's time (steps of 1 s x 1 decode, 2 s x 3, 10 s x 1: gaps
    1, 2, 2, 2, 10); `price` gives the quantiles of its own steps' times."""
    med, p99 = schedule._itl(np.array([1.0, 2.0, 10.0]), np.array([1.0, 3.0, 1.0]))
    assert (med, p99) == (2.0, 10.0)
    assert all(math.isnan(x) for x in schedule._itl(np.array([1.0]), np.array([0.0])))
    ls = schedule.lockstep(512, 64, 32, 4, 256, 16, 10**6, 64, 0, 0.8)
    r = schedule.price(ls, schedule.each_step(toy))
    times = [toy(b)[0] for b in ls.batches if b.decodes]
    assert r.median_itl_s in times and min(times) <= r.median_itl_s <= r.p99_itl_s <= max(times)
