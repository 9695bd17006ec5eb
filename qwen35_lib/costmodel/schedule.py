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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import deque
from typing import Callable

import numpy as np

from qwen35_lib.costmodel.ops import Batch

StepFn = Callable[[Batch], tuple[float, dict[str, float]]]  # one step: (seconds, {component: seconds})
StepsFn = Callable[[tuple[Batch, ...]], tuple[np.ndarray, dict[str, np.ndarray]]]  # n steps at once: (seconds [n],
# {component: seconds [n]}), the floats a StepFn gives for each


def each_step(step_fn: StepFn) -> StepsFn:
    """A `StepsFn` calling `step_fn` on each batch in turn (components in the order they first appear; one a step
    lacks: 0)."""
    def steps_fn(batches: tuple[Batch, ...]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        timed = [step_fn(b) for b in batches]
        names = list(dict.fromkeys(k for _, parts in timed for k in parts))
        return (np.array([t for t, _ in timed], dtype=np.float64),
                {k: np.array([p.get(k, 0.0) for _, p in timed], dtype=np.float64) for k in names})
    return steps_fn


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Speculative decoding as the schedule sees it: each decoding sequence's row holds its token and `drafts`
    drafts (`width` tokens of the step's budget) and emits `acceptance` tokens a step on average (the acceptance
    length: 1 + the drafts accepted; a labelled assumption, `costmodel.predict.acceptance_length`). Off: one token
    a row, one emitted (the integer play, unchanged)."""

    drafts: int = 0
    acceptance: float = 1.0

    def __post_init__(self):
        if self.drafts < 0 or not 1 <= self.acceptance <= self.drafts + 1:
            raise ValueError(f"speculation of {self.drafts} drafts with acceptance length {self.acceptance}: the "
                             f"acceptance length of k drafts lies in [1, k + 1]")

    @property
    def width(self) -> int:
        return self.drafts + 1

    @property
    def emit(self) -> float | int:
        return self.acceptance if self.drafts else 1

    def steps(self, left) -> int:
        """Decode steps a sequence with `left` output tokens to go runs (whole steps)."""
        return left if not self.drafts else max(1, math.ceil(left / self.acceptance - 1e-9))


NO_SPEC = Speculation()


EXACT_PROMPTS = 2048  # requests per rank played one by one (concurrency 8192 at DP 8, 1024 at DP 1)
STEADY_WINDOW = 512  # completions over which the bounded run measures the steady state, at least


@dataclasses.dataclass(slots=True)
class _Req:
    prompt: int
    output: int
    done_prompt: int = 0
    done_output: int = 0
    arrived: float | None = 0.0  # seconds into the run the client sent it (None: running before the run began)
    first: float = 0.0  # its first output token (the end of the step that completed its prompt)


def _latencies(done: list[tuple[float | None, float, float, int]]) -> tuple[float, float]:
    """(median time to first token, median time per output token after the first) over finished requests
    (arrived, first, finished, output), as `vllm bench serve` reports them; NaN when none qualifies."""
    kept = [d for d in done if d[0] is not None]
    return _latencies_of(np.array([d[:3] for d in kept], dtype=np.float64).reshape(-1, 3),
                         np.array([d[3] for d in kept], dtype=np.int64))


def _latencies_of(times: np.ndarray, outputs: np.ndarray) -> tuple[float, float]:
    """`_latencies` of requests that all arrived in the run, as arrays: times [n, 3] (arrived, first, finished),
    outputs [n] (`price` holds them so: a 1k/8k play finishes thousands)."""
    many = outputs > 1
    ttft = float(np.median(times[:, 1] - times[:, 0])) if len(times) else float("nan")
    tpot = float(np.median((times[many, 2] - times[many, 1]) / (outputs[many] - 1))) if many.any() else float("nan")
    return ttft, tpot


def _itl(per_step: np.ndarray, decodes: np.ndarray) -> tuple[float, float]:
    """(median, p99) inter-token latency as `vllm bench serve` collects it (one gap a streamed chunk, a chunk a
    decode row): each step's seconds `per_step` [steps], once for each of its `decodes` [steps]; NaN when none."""
    if decodes.sum() <= 0:
        return float("nan"), float("nan")
    order = np.argsort(per_step, kind="stable")
    cum = np.cumsum(decodes[order])
    at = lambda q: float(per_step[order][np.searchsorted(cum, q * cum[-1])])  # noqa: E731  (lower quantile)
    return at(0.5), at(0.99)


@dataclasses.dataclass(frozen=True)
class SimResult:
    seconds: float
    steps: int
    input_tokens: int
    output_tokens: int
    breakdown: dict[str, float]  # component -> seconds over the run
    mean_decode_batch: float  # decodes per step (whole slice), averaged over steps
    mean_running: float  # sequences per rank, averaged over steps
    played: int = 0  # requests per rank played step by step
    requests: int = 0  # requests per rank in the benchmark (more than `played`: the rest at the steady cost)
    median_ttft_s: float = float("nan")  # time to first token, median over the requests played
    median_tpot_s: float = float("nan")  # time per output token after the first, median
    median_itl_s: float = float("nan")  # inter-token latency over every decoded token: its step's time (`_itl`)
    p99_itl_s: float = float("nan")

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def draw_lengths(n: int, isl: int, osl: int, seed: int = 0, range_ratio: float = 0.8) -> list[tuple[int, int]]:
    """(input, output) lengths uniform in [ceil(r L), L] (data/workloads.json's convention), seeded."""
    rng = np.random.default_rng(seed)
    lo_i, lo_o = _low(isl, range_ratio), _low(osl, range_ratio)
    return list(zip(rng.integers(lo_i, isl + 1, n).tolist(), rng.integers(lo_o, osl + 1, n).tolist()))


def mean_lengths(isl: int, osl: int, range_ratio: float = 0.8) -> tuple[float, float]:
    """The expected (input, output) length of `draw_lengths`."""
    return (_low(isl, range_ratio) + isl) / 2, (_low(osl, range_ratio) + osl) / 2


def _low(n: int, range_ratio: float) -> int:
    return max(1, int(np.ceil(range_ratio * n)))


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
    All runs also advance runs of steps whose decodes take the whole budget together (`_play`'s `collapse`).
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
    ttft, tpot = _latencies(steady.finished[skip:skip + STEADY_WINDOW])  # the steady state's requests
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
    start = [_Req(i, o, done_prompt=i, done_output=int(rng.integers(0, o)), arrived=None) for i, o in lengths[:warm]]
    steady = _record(lengths[warm:], c, dp, max_batched_tokens, limit, marks=(skip, skip + window),
                     start=start, collapse=True, admit_lag=admit_lag, spec=spec)
    ramp = _record(draw_lengths(c + cap, isl, osl, seed, range_ratio), c, dp, max_batched_tokens, limit,
                   marks=(cap,), collapse=True, admit_lag=admit_lag, spec=spec)
    drain = _record([], len(steady.running), dp, max_batched_tokens, limit, start=steady.running, collapse=True,
                    spec=spec)
    return steady, ramp, drain


def median_queue_wait(clients: int, cap: int, prompts: int, rate: float) -> float:
    """Median wait in the queue before admission, beyond the steady run's (whose queue holds at most one), of a
    benchmark of `prompts` requests from `clients` clients at most `cap` of which run, completing `rate` requests
    per second: the first `clients` arrive together and the i-th waits for i - cap completions; each later one
    arrives as one finishes, behind the `clients - cap - 1` already queued."""
    arrived_first = min(clients, prompts)

    def waits(i: int) -> int:  # the i-th smallest wait (completions waited for): the first arrivals' are ascending
        return max(i - cap, 0) if i < arrived_first else max(clients - cap - 1, 0)  # and at most the later ones'

    return (waits((prompts - 1) // 2) + waits(prompts // 2)) / 2 / rate  # the median, in closed form


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
    running: list[_Req] = dataclasses.field(default_factory=list)  # requests still running when it stopped
    finished: list[tuple[float | None, float, float, int]] = dataclasses.field(default_factory=list)
    # (arrived, first token, finished, output tokens) per finished request, in completion order

    def result(self, dp: int) -> SimResult:
        ttft, tpot = _latencies(self.finished)
        return dataclasses.replace(self.totals.result(dp), played=self.completed, requests=self.completed,
                                   median_ttft_s=ttft, median_tpot_s=tpot)


def _play(step_fn: StepFn, lengths: list[tuple[int, int]], clients: int,
          dp: int, max_batched_tokens: int, limit: int, marks: tuple[int, ...] = (),
          start: list[_Req] | None = None, collapse: bool = False, trace: list | None = None,
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
    firsts: tuple[_Req, ...]  # requests whose first token it sampled
    finished: tuple[tuple[_Req, float | _At | None, float | _At], ...]  # (request, arrived, first) of each done


@dataclasses.dataclass
class _Record:
    id: int
    steps: list[_Step]
    snapshots: list[tuple[int, int]]  # (completions, steps recorded) at each mark
    completed: int
    running: list[_Req]


_RECORDS = iter(range(1 << 62))


def _record(lengths: list[tuple[int, int]], clients: int, dp: int, max_batched_tokens: int, limit: int,
            marks: tuple[int, ...] = (), start: list[_Req] | None = None, collapse: bool = False,
            admit_lag: int = 0, spec: Speculation = NO_SPEC) -> _Record:
    """`_play`'s schedule without its times: each step's batch and counts, and when requests arrive, sample their
    first token and finish, as `_At` times (a request's `arrived` and `first` hold them). A client's next request
    reaches the scheduler `admit_lag` steps after the step its last one finished in (`ADMISSION_LAG`)."""
    pid = next(_RECORDS)
    running: list[_Req] = list(start or [])
    waiting: deque[_Req] = deque(_Req(i, o) for i, o in lengths[:clients - len(running)])
    pending = deque(_Req(i, o) for i, o in lengths[clients - len(running):])
    delayed: deque[tuple[int, _Req]] = deque()  # (steps played when the scheduler sees it, request), arrival order
    steps: list[_Step] = []
    done = t = 0
    snapshots: list[tuple[int, int]] = []
    todo = list(marks)
    while waiting or running or delayed:
        _release(delayed, t, not (waiting or running), waiting.append)
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
            fields, firsts = _rank_step(running, waiting, max_batched_tokens, limit, spec)
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


ADMISSION_LAG = ("vLLM's engine core drains its input queue once a loop, then schedules; with --async-scheduling "
                 "(a batch queue of 2) it schedules step i + 1 before step i's outputs are read, so a request sent "
                 "on step i's outputs reaches a schedule only after step i + 1 ends and runs from step i + 3: 2 steps "
                 "after the simulation's i + 1 (1 step without async scheduling: it runs from step i + 2)")


def _release(delayed: deque, t: int, idle: bool, admit: Callable[[_Req], None]) -> None:
    """Hand `admit` each delayed request the scheduler sees after `t` steps; all of them when the engine is `idle`
    (no step in flight: a request is scheduled as it arrives)."""
    while delayed and (idle or delayed[0][0] <= t):
        admit(delayed.popleft()[1])


def _replay(records: tuple[_Record, ...], steps_fn: StepsFn) -> list[_Play]:
    """Recorded plays (in the order they were recorded) timed by `steps_fn` (every distinct step at once): each
    step's seconds and breakdown summed as `_play` sums them, its `_At` times in seconds (a later play's requests
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


# --- data-parallel ranks in lockstep -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Lockstep:
    """The schedule of `dp` ranks run together, as segments of identical slice steps (independent of step times:
    a rank's scheduler decides by tokens, not seconds). `batches[i]` runs `counts[i]` times; events are per
    request (arrived, first token, finished) in steps, `outputs` its output tokens."""

    batches: tuple[Batch, ...]
    counts: np.ndarray
    events: np.ndarray  # [requests, 3] step counts
    outputs: np.ndarray
    input_tokens: int
    output_tokens: int
    decodes: float  # decodes over all steps, whole slice
    running: float  # running sequences per rank, summed over steps (mean over ranks)
    played: int  # requests per rank played
    requests: int  # requests per rank in the benchmark
    clients: int = 0  # clients per rank in the benchmark (more than played: the rest only wait in the queue)
    cap: int = 0  # requests a rank runs at once, at most

    @functools.cached_property
    def distinct(self) -> tuple[tuple[Batch, ...], np.ndarray]:
        """The distinct batches, in order of first appearance, and the index of each step's among them [steps]."""
        index: dict[Batch, int] = {}
        at = [index.setdefault(b, len(index)) for b in self.batches]
        return tuple(index), np.array(at, dtype=np.int64)


LOCKSTEP_PROMPTS = 1024  # requests per rank the lockstep plays at most (8,192 on 8 ranks); beyond, scaled
CTX_GRAIN = 64  # lockstep contexts are rounded to this many tokens (fewer distinct steps to time; < 1 % at 8k)


def _pad(n: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per-rank token slots: the next power of two >= n, at least lo, at most the bucket covering hi."""
    top = 1 << max(0, int(np.ceil(np.log2(max(hi, 1)))))
    p = np.maximum(n, lo).astype(np.int64)
    p = 1 << np.ceil(np.log2(np.maximum(p, 1))).astype(np.int64)
    return np.minimum(p, top)


def _rank_step(running: list[_Req], waiting: deque, budget: int, limit: int, spec: Speculation = NO_SPEC
               ) -> tuple[tuple, list[_Req]]:
    """One step of one rank's scheduler (the module doc's 1-3): its batch fields (decodes, decode ctx, prompt
    tokens, prompt chunks, prompt ctx, longest ctx) and the requests whose first token it samples."""
    # every running request decodes but one part-way through its prompt (at most one, the last: prompts are
    # chunked in order and admitted at the end)
    decoders = running[:-1] if running and running[-1].done_prompt < running[-1].prompt else running
    n_dec = min(len(decoders), budget // spec.width)  # a row of 1 + drafts tokens each
    dec = decoders[:n_dec] if n_dec < len(decoders) else decoders
    e = spec.emit
    for r in dec:
        r.done_output += e
    ctx = [r.prompt + r.done_output for r in dec]  # after its decode
    budget -= n_dec * spec.width
    chunks: list[tuple[int, int]] = []  # (tokens, ctx before)
    chunked: list[_Req] = []  # in running order
    if budget > 0 and len(decoders) < len(running):
        r = running[-1]
        n = min(r.prompt - r.done_prompt, budget)
        chunks.append((n, r.done_prompt))
        chunked.append(r)
        r.done_prompt += n
        budget -= n
    while waiting and budget > 0 and len(running) < limit:
        r = waiting.popleft()
        running.append(r)
        n = min(r.prompt, budget)
        chunks.append((n, 0))
        chunked.append(r)
        r.done_prompt += n
        budget -= n
    if n_dec < len(decoders) and any(r.done_output == 0 for r in decoders[n_dec:]):  # a decoder left undecoded
        firsts = [r for r in running if r.done_prompt == r.prompt and r.done_output == 0]
    else:  # else only a prompt completed now is at its first token
        firsts = [r for r in chunked if r.done_prompt == r.prompt and r.done_output == 0]
    for r in firsts:
        r.done_output = 1
    pre = sum(c[0] for c in chunks)
    fields = (n_dec, sum(ctx) / len(ctx) if ctx else 0.0, pre, len(chunks),  # exact sums: np.mean's value
              sum(c[1] for c in chunks) / len(chunks) if chunks else 0.0,
              max([c[0] + c[1] for c in chunks] + ctx + [0]))
    return fields, firsts


def play_dp(lengths: list[tuple[int, int]], clients: int, dp: int, budget: int, limit: int,
            batch_prefills: bool, admit_lag: int = 0, spec: Speculation = NO_SPEC
            ) -> tuple[np.ndarray, list, list, float, float, float]:
    """`clients` clients over the slice, the DP scheduler of tpu-inference in front of `dp` rank schedulers: a new
    request goes to the rank with the fewest pending prompt tokens, then fewest requests in flight, then the
    soonest to free a slot; with `batch_prefills`, new requests are held until `dp` of them wait (or as many
    ranks were idle the step before), then routed together. Returns per-rank step fields [dp, steps, 6], the
    finished requests' (arrived, first, finished) in steps, their outputs, input and output tokens, and the
    running requests summed over steps and ranks. A client's next request reaches the DP scheduler `admit_lag` steps
    after the step its last one finished in (`ADMISSION_LAG`)."""
    running: list[list[_Req]] = [[] for _ in range(dp)]
    waiting: list[deque] = [deque() for _ in range(dp)]
    queue = deque(_Req(i, o) for i, o in lengths)
    held: list[_Req] = []
    delayed: deque[tuple[int, _Req]] = deque()  # (step when the scheduler sees it, request), in arrival order
    rows: list[list[tuple]] = [[] for _ in range(dp)]
    events, outputs = [], []
    t, inp, out, run, idle = 0, 0.0, 0.0, 0.0, dp

    def arrive(r: _Req) -> None:
        if batch_prefills:
            held.append(r)
        else:
            _route([r], running, waiting)

    for _ in range(min(clients, len(queue))):
        arrive(queue.popleft())
    while held or any(running) or any(waiting) or delayed:
        _release(delayed, t, not (held or any(running) or any(waiting)), arrive)
        if held and (not batch_prefills or len(held) >= dp or idle >= len(held)):
            _route(held, running, waiting)
            held = []
        # prompt work per rank: a request to admit, or one part-way through its prompt (at most one: the last
        # running, as prompts are chunked in order and admitted at the end)
        work = [bool(rr) and rr[-1].done_prompt < rr[-1].prompt or bool(w) and len(rr) < limit
                for rr, w in zip(running, waiting)]
        if not any(work) and any(running):  # a run of pure-decode steps on every rank until the first ends
            k_steps = spec.steps(min([q.output - q.done_output for rr in running for q in rr]))  # steps: monotone
            n_steps = min(k_steps, delayed[0][0] - t) if delayed else k_steps  # up to the next arrival
            _decode_run(running, rows, n_steps, budget, spec)
            idle = sum(1 for rr in running if not rr)
        else:
            n_steps, idle = 1, 0
            for k in range(dp):
                f, firsts = _rank_step(running[k], waiting[k], budget, limit, spec)
                rows[k].append((f, 1))
                idle += f[0] + f[2] == 0
                for q in firsts:
                    q.first = t + 1
        t += n_steps
        for k in range(dp):
            run += len(running[k]) * n_steps
            done = [q for q in running[k] if q.done_output >= q.output]
            if done:
                running[k] = [q for q in running[k] if q.done_output < q.output]
            for q in done:
                events.append((q.arrived, q.first, t))
                outputs.append(q.output)
                inp, out = inp + q.prompt, out + q.output
                if queue:
                    delayed.append((t + admit_lag, dataclasses.replace(queue.popleft(), arrived=t)))
    return _fields(rows), events, outputs, inp, out, run


def _route(rs: list[_Req], running: list[list[_Req]], waiting: list[deque]) -> None:
    """Each of `rs` to the rank with the fewest pending prompt tokens, then fewest requests in flight, then the
    soonest to free a slot (`play_dp`'s DP scheduler)."""
    keys = [(sum(q.prompt - q.done_prompt for q in rr) + sum(q.prompt for q in w), len(rr) + len(w),
             min((q.output - q.done_output for q in rr), default=0)) for rr, w in zip(running, waiting)]
    for r in rs:
        k = min(range(len(keys)), key=keys.__getitem__)
        waiting[k].append(r)
        pend, n, rem = keys[k]
        keys[k] = (pend + r.prompt, n + 1, rem)


def _decode_run(running: list[list[_Req]], rows: list[list[tuple]], k_steps: int, budget: int,
                spec: Speculation) -> None:
    """`k_steps` pure-decode steps on every rank at once: each rank's row of fields (at the run's middle step) and
    its requests' outputs advanced."""
    e = spec.emit
    mid = e * (k_steps + 1) / 2  # the run's middle step, past each context
    for rr, rk in zip(running, rows):
        dec = rr[:budget // spec.width]  # no prompt part-way: every running request decodes
        ctx = [q.prompt + q.done_output for q in dec]  # ints: sum(ctx) + n mid is the exact float sum
        rk.append(((len(dec), (sum(ctx) + len(ctx) * mid) / len(ctx) if ctx else 0.0, 0, 0, 0.0,
                    int(max(ctx) + mid + e * k_steps / 2) if ctx else 0), k_steps))
        for q in dec:
            q.done_output += e * k_steps


def _fields(rows: list[list[tuple]]) -> np.ndarray:
    """Per-rank (fields, steps) rows as [dp, steps, 6], each row repeated over its steps, short ranks zero-padded."""
    F = []
    for rk in rows:
        f = np.array([x for x, _ in rk], dtype=np.float64).reshape(-1, 6)
        F.append(np.repeat(f, np.array([n for _, n in rk], dtype=np.int64), axis=0))
    FF = np.zeros((len(rows), max(len(x) for x in F), 6))
    for k, x in enumerate(F):
        FF[k, :len(x)] = x
    return FF


@functools.lru_cache(maxsize=4)  # a play of 1k/8k at 512 requests holds [8, 88k, 6] float64 (34 MB)
def _played(isl: int, osl: int, dp: int, max_batched_tokens: int, limit: int, played_clients: int, prompts: int,
            seed: int, range_ratio: float, dispatch: str, slice_clients: int | None = None, admit_lag: int = 0,
            spec: Speculation = NO_SPEC) -> tuple[np.ndarray, list, list, float, float, float]:
    """`lockstep`'s play of the ranks: per-rank step fields [dp, steps, 6] (read-only), the finished requests'
    (arrived, first, finished) in steps, their outputs, input and output tokens, running requests summed over
    steps; kept by what it depends on, so that lockstep schedules differing only in the padding, or in a memory
    cap above `max_seqs` (another stage or model), share one play. `slice_clients`: the DP scheduler's clients over
    the slice (default `played_clients` x dp; fewer where the concurrency is below dp: idle ranks stay idle)."""
    unit = lambda b: (1.0, {})  # noqa: E731  (times in steps)
    cols, events, outputs, inp, out, run = [], [], [], 0, 0, 0.0
    if dispatch != "rank":
        F, events, outputs, inp, out, run = play_dp(
            draw_lengths(prompts * dp, isl, osl, seed, range_ratio), slice_clients or played_clients * dp, dp,
            max_batched_tokens, limit, dispatch == "batch", admit_lag, spec)
        cols = [F[k] for k in range(dp)]
    for r in range(dp if dispatch == "rank" else 0):
        tr: list = []
        p = _play(unit, draw_lengths(prompts, isl, osl, seed + 7919 * r, range_ratio), played_clients, 1,
                  max_batched_tokens, limit, collapse=True, trace=tr, admit_lag=admit_lag, spec=spec)
        n = np.array([c for _, c in tr], dtype=np.int64)
        f = np.array([(b.decodes, b.decode_ctx, b.prefill_tokens, b.prefill_seqs, b.prefill_ctx, b.max_ctx)
                      for b, _ in tr], dtype=np.float64).reshape(-1, 6)
        cols.append(np.repeat(f, n, axis=0))
        events += [(a if a is not None else 0.0, fi, e) for a, fi, e, _ in p.finished]
        outputs += [o for *_, o in p.finished]
        inp, out, run = inp + p.totals.inp, out + p.totals.out, run + p.totals.run_sum
    S = max(len(c) for c in cols)
    F = np.zeros((dp, S, 6))
    for r, c in enumerate(cols):
        F[r, :len(c)] = c
    F.setflags(write=False)
    return F, events, outputs, inp, out, run


@functools.lru_cache(maxsize=64)
def lockstep(isl: int, osl: int, concurrency: int, dp: int, max_batched_tokens: int, max_seqs: int,
             max_running: int, num_prompts: int | None = None, seed: int = 0, range_ratio: float = 0.8,
             min_slot: int = 4, padding: bool = True, dispatch: str = "batch", admit_lag: int = 0,
             spec: Speculation = NO_SPEC) -> Lockstep:
    """Play each of the `dp` ranks with its own clients and lengths (seeded per rank), then merge them step by
    step: a slice step is every rank's step at that index; its per-device work is the busiest rank's (most
    tokens, then most attention work), its token slots the busiest rank's padded to `_pad`'s bucket (with
    `padding`), so the MoE computes dp x that many rows. Requests per rank are capped at `EXACT_PROMPTS`
    (beyond, the throughput is that of the played run: a rank holds at most `max_seqs` requests, so the steady
    state is reached long before).
    `dispatch`: "batch" or "each" (the DP scheduler routes requests over the ranks, `play_dp`, holding new ones
    until dp of them wait, or not), "rank" (each rank its own clients and lengths, seeded per rank).
    `admit_lag`: steps a client's next request waits before the scheduler sees it (`ADMISSION_LAG`); `spec`:
    speculative decoding (`Speculation`: a decode row's tokens and what it emits)."""
    clients = max(1, round(concurrency / dp))
    requests = max(clients, round((num_prompts or 2 * concurrency) / dp))
    limit = max(1, min(max_seqs, max_running))
    cap = min(limit, max_batched_tokens // spec.width + 1)
    played_clients = min(clients, cap + 1)  # more only wait (`_bounded`, 1.); their wait is added to the TTFT
    prompts = min(requests, max(LOCKSTEP_PROMPTS, played_clients))
    # the DP scheduler's clients: the concurrency itself where it is below dp x played_clients (c4 on DP 8: four
    # ranks busy, four idle; rounding it up to one a rank played 8 clients and counted twice the tokens)
    slice_clients = min(concurrency, played_clients * dp)
    F, events, outputs, inp, out, run = _played(isl, osl, dp, max_batched_tokens, limit, played_clients, prompts,
                                                seed, range_ratio, dispatch,
                                                slice_clients if slice_clients < played_clients * dp else None,
                                                admit_lag, spec)
    S = F.shape[1]
    tokens = F[..., 0] * spec.width + F[..., 2]
    work = F[..., 0] * F[..., 1] + F[..., 2] * (F[..., 4] + F[..., 2])
    crit = np.lexsort((work, tokens), axis=0)[-1]  # per step: the rank with most tokens, then most work
    C = F[crit, np.arange(S)]  # [S, 6]
    C[:, [1, 4, 5]] = np.rint(C[:, [1, 4, 5]] / CTX_GRAIN) * CTX_GRAIN  # contexts to CTX_GRAIN tokens
    seqs = (F[..., 0] + F[..., 3]).max(axis=0)
    slot = _pad(tokens.max(axis=0), min_slot, max_batched_tokens) if padding else tokens.max(axis=0)
    key = np.column_stack([C, slot, seqs])
    change = np.ones(S, dtype=bool)
    change[1:] = np.any(key[1:] != key[:-1], axis=1)
    starts = np.flatnonzero(change)
    counts = np.diff(np.append(starts, S))
    batches = tuple(Batch(decodes=int(c[0]) * dp, decode_ctx=float(c[1]), prefill_tokens=int(c[2]) * dp,
                          prefill_seqs=int(c[3]) * dp, prefill_ctx=float(c[4]), max_ctx=int(c[5]),
                          padded_tokens=int(sl) * dp if padding else 0, logit_rows=max(int(q), 1) * dp,
                          drafts=spec.drafts if c[0] else 0)
                    for c, sl, q in zip(C[starts], slot[starts], seqs[starts]))
    return Lockstep(batches, counts, np.array(events, dtype=np.float64).reshape(-1, 3),
                    np.array(outputs, dtype=np.int64), int(round(inp)), int(round(out)),
                    float(F[..., 0].sum()), run / dp, prompts, requests, clients, cap)


def price(ls: Lockstep, steps_fn: StepsFn) -> SimResult:
    """The lockstep schedule timed by `steps_fn` (its distinct steps at once): seconds, breakdown, the latencies
    of every request and the inter-token latencies of every decoded token (`_itl`). A benchmark longer than the
    played run is the played run's cost per request times its requests; clients who could not run wait in the
    queue (`median_queue_wait`, added to the TTFT)."""
    batches, at = ls.distinct
    secs, by_name = steps_fn(batches)  # [distinct], {component: [distinct]}
    names = sorted(by_name)
    secs = secs[at]  # [steps]
    parts = np.column_stack([by_name[k] for k in names])[at] if names else np.zeros((len(at), 0))  # [steps, names]
    breakdown = dict(zip(names, (ls.counts @ parts).tolist()))
    per_step = np.repeat(secs, ls.counts)
    cum = np.concatenate([[0.0], np.cumsum(per_step)])
    steps = int(ls.counts.sum())
    at = cum[np.clip(np.rint(ls.events).astype(np.int64), 0, steps)]  # [finished, 3] seconds
    ttft, tpot = _latencies_of(at, ls.outputs)
    k = ls.requests / ls.played
    if ls.clients > ls.cap + 1:
        ttft += median_queue_wait(ls.clients, ls.cap, ls.requests, ls.played / cum[-1])
    itl = _itl(per_step, np.repeat(np.array([b.decodes for b in ls.batches], dtype=np.float64), ls.counts))
    return SimResult(float(cum[-1]) * k, round(steps * k), round(ls.input_tokens * k), round(ls.output_tokens * k),
                     {n: v * k for n, v in breakdown.items()}, ls.decodes / max(steps, 1), ls.running / max(steps, 1),
                     played=ls.played, requests=ls.requests, median_ttft_s=ttft, median_tpot_s=tpot,
                     median_itl_s=itl[0], p99_itl_s=itl[1])
