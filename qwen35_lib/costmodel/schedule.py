"""Throughput from a simulation of the scheduler, not from one step.

`simulate(steps_fn, ...)` plays a closed-loop benchmark (the InferenceX protocol: `concurrency` clients, each
sending its next request when the last one ends, `num_prompts` in all, lengths uniform in [r L, L], r = 0.8 by
default, seeded) against one data-parallel rank; ranks are balanced, so the slice does `dp` times the rank's work
per step.
Each step, as the engine's scheduler (qwen35_lib/engine/scheduler.py) and vLLM's do:
1. every running request past its prompt decodes one token;
2. requests part-way through their prompt continue with the next chunk, within the token budget;
3. waiting requests are admitted while the budget, `max_seqs` and the memory cap (`max_running`) allow.
A request finishes after its output length; a new one arrives at once while prompts remain, and the scheduler
sees it `admit_lag` steps later (`ADMISSION_LAG`: the steps the engine core has in flight when it next reads its
input queue; 0 plays the old model, which admitted it in the very next step). A step's time is
what `steps_fn` (a `StepsFn`) gives its whole-slice `ops.Batch`: every distinct step of a play is timed in one call
(`each_step(step_fn)` wraps a function of one batch). Runs of pure-decode steps (no prompt work anywhere) are
advanced together: k steps at the time of their middle step (exact when step time is linear in the context).
No scheduling decision reads a step's time, so each play is recorded once (`_record`, cached by its arguments) and
timed by each timing function (`_replay`): a band's reruns and a sweep's specs re-time the same recording.

The work is bounded whatever the concurrency: up to `EXACT_PROMPTS` requests per rank, every request is
played; beyond, every request's tokens at the steady-state cost per token (measured on a run started in
steady state, with one client more than can run at once: more only wait) plus what filling the rank and
draining it cost beyond that (`_bounded`).
The pieces every play shares (the request, one rank's step, the admission lag, the latencies, `SimResult`) are in
`play`; the ranks played together in lockstep, in `lockstep`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import deque

import numpy as np

from qwen35_lib.costmodel.ops import Batch
from qwen35_lib.costmodel.play import (
    NO_SPEC,
    Req,
    SimResult,
    Speculation,
    StepFn,
    StepsFn,
    draw_lengths,
    each_step,
    latencies,
    mean_lengths,
    median_queue_wait,
    rank_step,
    release,
)

EXACT_PROMPTS = 2048  # requests per rank played one by one (concurrency 8192 at DP 8, 1024 at DP 1)
STEADY_WINDOW = 512  # completions over which the bounded run measures the steady state, at least


def simulate(steps_fn: StepsFn, isl: int, osl: int, concurrency: int, dp: int, max_batched_tokens: int,
             max_seqs: int, max_running: int, num_prompts: int | None = None, seed: int = 0,
             range_ratio: float = 0.8, admit_lag: int = 0, spec: Speculation = NO_SPEC) -> SimResult:
    """Play the benchmark on one rank (see the module doc); `steps_fn` (`StepsFn`) times the play's distinct steps.

    `concurrency` clients over the slice (concurrency / dp per rank); `max_seqs` and `max_running` (memory)
    bound the running sequences per rank; `max_batched_tokens` is the rank's token budget per step.
    `admit_lag`: steps a client's next request waits before the scheduler can see it (`ADMISSION_LAG`).
    `spec`: speculative decoding's rows and acceptance (`Speculation`).
    Up to `EXACT_PROMPTS` requests per rank, every request is played; beyond, a bounded sample (`_bounded`).
    """
    clients = max(1, round(concurrency / dp))
    prompts = max(clients, round((num_prompts or 2 * concurrency) / dp))
    limit = max(1, min(max_seqs, max_running))
    if prompts > EXACT_PROMPTS:
        bounded = _bounded(steps_fn, isl, osl, clients, prompts, dp, max_batched_tokens, limit, seed, range_ratio,
                           admit_lag, spec)
        if bounded is not None:
            return bounded
    play, = _replay(_exact_record(isl, osl, clients, prompts, dp, max_batched_tokens, limit, seed, range_ratio,
                                  admit_lag, spec), steps_fn)
    return play.result(dp)


@functools.lru_cache(maxsize=16)
def _exact_record(isl: int, osl: int, clients: int, prompts: int, dp: int, max_batched_tokens: int, limit: int,
                  seed: int, range_ratio: float, admit_lag: int = 0, spec: Speculation = NO_SPEC) -> tuple[_Record]:
    """`simulate`'s play of every request, recorded once (the schedule does not depend on the step times)."""
    return (_record(draw_lengths(prompts, isl, osl, seed, range_ratio), clients, dp, max_batched_tokens, limit,
                    admit_lag=admit_lag, spec=spec),)


def _bounded(steps_fn: StepsFn, isl: int, osl: int, clients: int, prompts: int, dp: int,
             max_batched_tokens: int, limit: int, seed: int, range_ratio: float,
             admit_lag: int = 0, spec: Speculation = NO_SPEC) -> SimResult | None:
    """The benchmark of `prompts` requests per rank from three short runs, in a time independent of `prompts` and
    `clients` (None when the three runs would be about the whole benchmark).

    1. At most `cap = min(limit, max_batched_tokens + 1)` requests run at once: decodes take a budget token
       each and a prompt chunk at least one, so prompts complete only while fewer than `max_batched_tokens`
       requests decode, and at most one prompt is left part-way after a step. More clients than `cap` only
       wait, and the queue is never empty until every request has been admitted: the run is the same with
       `c = cap + 1` clients as with any number above.
    2. Steady state: `c` clients with every slot already running a request part-way through its output (a
       uniform fraction of it), so completions are spread in time, as in a long run; after `skip`
       completions, the steps up to `STEADY_WINDOW` more give the cost of one computed token (seconds, steps,
       decodes, running sequences, breakdown). (Counting tokens computed rather than requests completed keeps
       the window's edges from adding the noise of the requests part-way through.)
    3. Ramp: `c` clients from an empty rank up to the first `cap` completions, each client sending its next
       request as one ends; its excess over the steady cost of the tokens it computed is the cost of filling
       the rank.
    4. Drain: the steady run's running requests played to the end with nothing more arriving; its excess over
       the steady cost is the cost of the last requests finishing one by one (in a long run they finish spread
       over up to an output length, not together: a run of only `c` requests from the start would end with
       its stragglers, which a long run does not have).
    5. The benchmark = the steady cost of every request's expected tokens + the two excesses.
    All runs also advance runs of steps whose decodes take the whole budget together (`play_rank`'s `collapse`).
    Measured against playing every request (tests/costmodel/test_schedule.py). Its cost grows with `cap`, not with
    `clients` or `prompts`.
    """
    cap = min(limit, max_batched_tokens // spec.width + 1)
    c = min(clients, cap + 1)
    if c + 2 * cap >= prompts:
        return None
    skip = min(c, limit, max_batched_tokens // spec.width, STEADY_WINDOW)  # `warm` in `_bounded_records`
    records = _bounded_records(isl, osl, c, cap, dp, max_batched_tokens, limit, seed, range_ratio, STEADY_WINDOW,
                               admit_lag, spec)
    steady, ramp, drain = _replay(records, steps_fn)
    (_, a), (_, b) = steady.snapshots
    mean_in, mean_out = mean_lengths(isl, osl, range_ratio)
    work = prompts * (mean_in + mean_out - 1)  # tokens computed: the first output token is the prefill's
    unit = b.work - a.work

    def total(x0: float, x1: float, *parts: float) -> float:  # steady cost of `work` + each part's excess
        rate = (x1 - x0) / unit
        return rate * work + sum(p - rate * w for p, w in zip(parts, (ramp.totals.work, drain.totals.work)))

    fields = ("t", "steps", "dec_sum", "run_sum")
    full = _Totals(**{f: total(getattr(a, f), getattr(b, f), getattr(ramp.totals, f), getattr(drain.totals, f))
                      for f in fields},
                   breakdown={k: total(a.breakdown.get(k, 0.0), v, ramp.totals.breakdown.get(k, 0.0),
                                       drain.totals.breakdown.get(k, 0.0)) for k, v in b.breakdown.items()},
                   inp=prompts * mean_in, out=prompts * mean_out)
    ttft, tpot = latencies(steady.finished[skip:skip + STEADY_WINDOW])  # the steady state's requests
    ttft += median_queue_wait(clients, cap, prompts, STEADY_WINDOW / (b.t - a.t))
    return dataclasses.replace(full.result(dp), played=ramp.completed + steady.completed + drain.completed,
                               requests=prompts, median_ttft_s=ttft, median_tpot_s=tpot)


@functools.lru_cache(maxsize=16)
def _bounded_records(isl: int, osl: int, c: int, cap: int, dp: int, max_batched_tokens: int, limit: int, seed: int,
                     range_ratio: float, window: int, admit_lag: int = 0, spec: Speculation = NO_SPEC
                     ) -> tuple[_Record, _Record, _Record]:
    """`_bounded`'s steady, ramp and drain runs (its items 2-4), recorded once: the schedule does not depend on the
    step times, which `_replay` adds for each step function."""
    warm = min(c, limit, max_batched_tokens // spec.width)  # requests running at the start of the steady-state run
    skip = min(warm, window)
    lengths = draw_lengths(warm + skip + window + c, isl, osl, seed + 1, range_ratio)
    rng = np.random.default_rng(seed + 2)
    start = [Req(i, o, done_prompt=i, done_output=int(rng.integers(0, o)), arrived=None) for i, o in lengths[:warm]]
    steady = _record(lengths[warm:], c, dp, max_batched_tokens, limit, marks=(skip, skip + window),
                     start=start, collapse=True, admit_lag=admit_lag, spec=spec)
    ramp = _record(draw_lengths(c + cap, isl, osl, seed, range_ratio), c, dp, max_batched_tokens, limit,
                   marks=(cap,), collapse=True, admit_lag=admit_lag, spec=spec)
    drain = _record([], len(steady.running), dp, max_batched_tokens, limit, start=steady.running, collapse=True,
                    spec=spec)
    return steady, ramp, drain


@dataclasses.dataclass
class _Totals:
    """Sums over the run so far (per rank, except `dec_sum`: whole slice)."""

    t: float = 0.0
    steps: float = 0
    dec_sum: float = 0.0
    run_sum: float = 0.0
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict)
    inp: float = 0  # tokens of the finished requests
    out: float = 0
    work: float = 0  # tokens computed: prompt tokens and decodes (a request's first output token is its prefill's)

    def snapshot(self) -> _Totals:
        return dataclasses.replace(self, breakdown=dict(self.breakdown))

    def result(self, dp: int) -> SimResult:
        steps = round(self.steps)
        return SimResult(self.t, steps, round(self.inp) * dp, round(self.out) * dp, self.breakdown,
                         self.dec_sum / max(steps, 1), self.run_sum / max(steps, 1))


@dataclasses.dataclass
class _Play:
    totals: _Totals
    snapshots: list[tuple[int, _Totals]]  # (completions, totals) after the first step reaching each mark
    completed: int  # requests finished
    running: list[Req] = dataclasses.field(default_factory=list)  # requests still running when it stopped
    finished: list[tuple[float | None, float, float, int]] = dataclasses.field(default_factory=list)
    # (arrived, first token, finished, output tokens) per finished request, in completion order

    def result(self, dp: int) -> SimResult:
        ttft, tpot = latencies(self.finished)
        return dataclasses.replace(self.totals.result(dp), played=self.completed, requests=self.completed,
                                   median_ttft_s=ttft, median_tpot_s=tpot)


def play_rank(step_fn: StepFn, lengths: list[tuple[int, int]], clients: int,
          dp: int, max_batched_tokens: int, limit: int, marks: tuple[int, ...] = (),
          start: list[Req] | None = None, collapse: bool = False, trace: list | None = None,
          admit_lag: int = 0, spec: Speculation = NO_SPEC) -> _Play:
    """The closed loop of `clients` clients over the requests of `lengths` (steps 1-3 of the module doc), the
    clients of `start` with their requests already running; with `marks`, it stops at the last one. With
    `collapse`, a run of steps whose decodes take the whole budget (no prompt work fits) is also advanced
    together, as a run of pure-decode steps is. With `trace`, each (batch, steps) is appended to it.
    (`_record` plays the schedule, `_replay` times it with `step_fn`.)"""
    rec = _record(lengths, clients, dp, max_batched_tokens, limit, marks, start, collapse, admit_lag, spec)
    if trace is not None:
        trace += [(st.batch, st.n) for st in rec.steps]
    return _replay((rec,), each_step(step_fn))[0]


@dataclasses.dataclass(frozen=True)
class _At:
    """A time of a recorded play: the end of its `step`-th step (0: its start), in seconds once replayed."""

    play: int
    step: int


@dataclasses.dataclass(frozen=True)
class _Step:
    batch: Batch
    n: int  # steps it stands for
    dec: int  # decodes of the slice over them
    work: int  # tokens computed on the rank
    run: int  # running requests of the rank summed over them
    firsts: tuple[Req, ...]  # requests whose first token it sampled
    finished: tuple[tuple[Req, float | _At | None, float | _At], ...]  # (request, arrived, first) of each done


@dataclasses.dataclass
class _Record:
    id: int
    steps: list[_Step]
    snapshots: list[tuple[int, int]]  # (completions, steps recorded) at each mark
    completed: int
    running: list[Req]


_RECORDS = iter(range(1 << 62))


def _record(lengths: list[tuple[int, int]], clients: int, dp: int, max_batched_tokens: int, limit: int,
            marks: tuple[int, ...] = (), start: list[Req] | None = None, collapse: bool = False,
            admit_lag: int = 0, spec: Speculation = NO_SPEC) -> _Record:
    """`play_rank`'s schedule without its times: each step's batch and counts, and when requests arrive, sample their
    first token and finish, as `_At` times (a request's `arrived` and `first` hold them). A client's next request
    reaches the scheduler `admit_lag` steps after the step its last one finished in (`ADMISSION_LAG`)."""
    pid = next(_RECORDS)
    running: list[Req] = list(start or [])
    waiting: deque[Req] = deque(Req(i, o) for i, o in lengths[:clients - len(running)])
    pending = deque(Req(i, o) for i, o in lengths[clients - len(running):])
    delayed: deque[tuple[int, Req]] = deque()  # (steps played when the scheduler sees it, request), arrival order
    steps: list[_Step] = []
    done = t = 0
    snapshots: list[tuple[int, int]] = []
    todo = list(marks)
    while waiting or running or delayed:
        release(delayed, t, not (waiting or running), waiting.append)
        firsts = []
        prompt_work = bool(waiting) and len(running) < limit or any(r.done_prompt < r.prompt for r in running)
        decoders = [r for r in running if r.done_prompt == r.prompt]
        w, e = spec.width, spec.emit  # budget tokens a decode row takes, tokens it emits a step
        if collapse and len(decoders) * w >= max_batched_tokens:  # the budget's first decoders run alone
            prompt_work, decoders = False, decoders[:max_batched_tokens // w]
        if not prompt_work:  # 1'. a run of pure-decode steps until the first request ends or one arrives
            k = min(spec.steps(r.output - r.done_output) for r in decoders)
            k = min(k, delayed[0][0] - t) if delayed else k
            ctx = [r.prompt + r.done_output + e * (k + 1) / 2 for r in decoders]  # middle of the run
            batch = Batch(decodes=len(decoders) * dp, decode_ctx=float(np.mean(ctx)),
                          max_ctx=int(max(ctx) + e * k / 2), drafts=spec.drafts)
            for r in decoders:
                r.done_output += e * k
            n_steps, dec, work = k, k * len(decoders) * dp, e * k * len(decoders)
        else:  # 1-3. one mixed step
            fields, firsts = rank_step(running, waiting, max_batched_tokens, limit, spec)
            n_dec, decode_ctx, pre, seqs, prefill_ctx, max_ctx = fields
            batch = Batch(decodes=n_dec * dp, decode_ctx=decode_ctx, prefill_tokens=pre * dp, prefill_seqs=seqs * dp,
                          prefill_ctx=prefill_ctx, max_ctx=math.ceil(max_ctx), drafts=spec.drafts if n_dec else 0)
            n_steps, dec, work = 1, n_dec * dp, n_dec * e + pre
        now = _At(pid, len(steps) + 1)
        t += n_steps
        for r in firsts:
            r.first = now
        run = len(running) * n_steps
        finished = []
        for r in [r for r in running if r.done_output >= r.output]:  # finished: the client sends its next
            running.remove(r)
            done += 1
            finished.append((r, r.arrived, r.first))
            if pending:
                delayed.append((t + admit_lag, dataclasses.replace(pending.popleft(), arrived=now)))
        steps.append(_Step(batch, n_steps, dec, work, run, tuple(firsts), tuple(finished)))
        while todo and done >= todo[0]:
            snapshots.append((done, len(steps)))
            todo.pop(0)
        if marks and not todo:
            break
    return _Record(pid, steps, snapshots, done, running)


def _replay(records: tuple[_Record, ...], steps_fn: StepsFn) -> list[_Play]:
    """Recorded plays (in the order they were recorded) timed by `steps_fn` (every distinct step at once): each
    step's seconds and breakdown summed as `play_rank` sums them, its `_At` times in seconds (a later play's requests
    may carry an earlier one's)."""
    batches = tuple(dict.fromkeys(st.batch for rec in records for st in rec.steps))  # distinct, in order
    secs, parts = steps_fn(batches) if batches else (np.zeros(0), {})
    index = {b: i for i, b in enumerate(batches)}
    seconds = secs.tolist()
    names = list(parts)
    per = np.column_stack([parts[k] for k in names]) if names else np.zeros((len(batches), 0))  # [distinct, names]
    times: dict[int, list[float]] = {}

    def sec(v):
        return times[v.play][v.step] if isinstance(v, _At) else v

    out = []
    for rec in records:
        tot = _Totals()
        at = times[rec.id] = [tot.t]
        finished: list[tuple[float | None, float, float, int]] = []
        snaps = iter(rec.snapshots)
        snap = next(snaps, None)
        snapshots: list[tuple[int, _Totals]] = []
        done = 0
        steps = [index[st.batch] for st in rec.steps]
        n = np.array([st.n for st in rec.steps], dtype=np.float64)
        # the breakdown after each step [steps, names]: each step's parts times its n, summed in step order
        sums = np.cumsum(per[steps] * n[:, None], axis=0)
        for i, st in enumerate(rec.steps, 1):
            s = seconds[steps[i - 1]]
            tot.dec_sum += st.dec
            tot.work += st.work
            tot.t += s * st.n
            at.append(tot.t)
            tot.steps += st.n
            tot.run_sum += st.run
            for r, arrived, first in st.finished:
                done += 1
                tot.inp += r.prompt
                tot.out += r.output
                finished.append((sec(arrived), sec(first), tot.t, r.output))
            while snap is not None and snap[1] == i:
                tot.breakdown = dict(zip(names, sums[i - 1].tolist()))
                snapshots.append((snap[0], tot.snapshot()))
                snap = next(snaps, None)
        tot.breakdown = dict(zip(names, sums[-1].tolist())) if len(sums) else {}
        out.append(_Play(tot, snapshots, rec.completed, rec.running, finished))
    return out
