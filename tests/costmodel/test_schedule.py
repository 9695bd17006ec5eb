"""costmodel.schedule: the serving simulation of one rank against hand-computed runs, its bounded form against
playing every request, and a client's next request waiting for the steps in flight."""

from __future__ import annotations

import dataclasses

import pytest

from qwen35_lib import costmodel
from qwen35_lib.costmodel import lockstep, schedule


def test_bounded_simulation_agrees_with_playing_every_request(monkeypatch):
    """Where both run (concurrency 8192: 2048 requests per rank), the bounded estimate is within 1.5 % of
    playing every request (measured: 0.05-0.7 % at 1k/8k)."""
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
    from qwen35_lib.costmodel.play import draw_lengths, each_step
    from qwen35_lib.costmodel.schedule import simulate

    r = simulate(each_step(linear_step), 64, 5, 1, 1, 256, 8, 8, num_prompts=1, seed=0)
    ((prompt, output),) = draw_lengths(1, 64, 5, 0)
    assert r.median_ttft_s == pytest.approx(1e-3 + 1e-6 * prompt, rel=1e-9)
    decodes = [1e-3 + 1e-6 + 1e-9 * (prompt + i) for i in range(2, output + 1)]  # the i-th token reads prompt + i
    assert r.median_tpot_s == pytest.approx(sum(decodes) / (output - 1), rel=1e-9)


@pytest.mark.parametrize("budget, max_running", [(256, 12), (8, 10**6)], ids=["memory-bound", "budget-bound"])
def test_more_clients_than_can_run_only_wait(budget, max_running):
    """The claim the bounded simulation rests on: with more clients than `min(max_running, budget + 1)` the
    queue never empties before the last request, so the run is the same with any number of them."""
    from qwen35_lib.costmodel.play import each_step
    from qwen35_lib.costmodel.schedule import simulate

    cap = min(max_running, budget + 1)
    runs = [simulate(each_step(linear_step), 64, 32, clients, 1, budget, 10**9, max_running, num_prompts=300)
            for clients in (cap + 1, 3 * cap, 300)]
    same = [dataclasses.replace(r, median_ttft_s=0.0) for r in runs]  # waiting longer is all they change
    assert same[0] == same[1] == same[2]
    assert runs[0].median_ttft_s < runs[1].median_ttft_s < runs[2].median_ttft_s
    fewer = simulate(each_step(linear_step), 64, 32, cap // 2, 1, budget, 10**9, max_running, num_prompts=300)
    assert fewer.seconds != runs[0].seconds  # (well below the cap, clients matter)


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_a_clients_next_request_waits_for_the_steps_in_flight(lag):
    """The admission lag (issue 55, TTFT): a request sent on its predecessor's last output runs `lag` steps later
    than at once, in the one-rank play and under the DP scheduler alike; a request sent to an idle engine does not
    wait. Client A decodes 50 tokens while client B's three short requests (a one-step prompt, 3 tokens) follow
    one another, so B's second and third each arrive while A keeps steps in flight."""
    lengths = [(4, 50), (4, 3), (4, 3), (4, 3)]
    unit = lambda b: (1.0, {})  # noqa: E731  (times in steps)
    p = schedule.play_rank(unit, lengths, 2, 1, 64, 8, admit_lag=lag)
    later = sorted((f[0], f[1]) for f in p.finished if f[0])  # (arrived, first token) of the requests sent later
    assert [first - arrived for arrived, first in later] == [1 + lag] * 2
    _, events, *_ = lockstep.play_dp(lengths, 2, 1, 64, 8, False, admit_lag=lag)
    later = sorted((a, f) for a, f, _ in events if a)
    assert [first - arrived for arrived, first in later] == [1 + lag] * 2
    alone = schedule.play_rank(unit, [(4, 3), (4, 3)], 1, 1, 64, 8, admit_lag=lag)  # one client: the engine idles
    assert [f[1] - f[0] for f in alone.finished] == [1, 1]
