"""Data-parallel ranks in lockstep: `lockstep` plays the ranks (each its own clients, or tpu-inference's DP
scheduler in front of them: `play_dp`) and merges them step by step into slice steps (the busiest rank's work, its
token slots padded); `price` times that schedule with a `StepsFn`. The pieces each play shares are in `play`; one
rank alone is `schedule`'s."""

from __future__ import annotations

import dataclasses
import functools
from collections import deque

import numpy as np

from qwen35_lib.costmodel.ops import Batch
from qwen35_lib.costmodel.play import (
    NO_SPEC,
    Req,
    SimResult,
    Speculation,
    StepsFn,
    draw_lengths,
    itl,
    latencies_of,
    median_queue_wait,
    rank_step,
    release,
)
from qwen35_lib.costmodel.schedule import play_rank


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
    running: list[list[Req]] = [[] for _ in range(dp)]
    waiting: list[deque] = [deque() for _ in range(dp)]
    queue = deque(Req(i, o) for i, o in lengths)
    held: list[Req] = []
    delayed: deque[tuple[int, Req]] = deque()  # (step when the scheduler sees it, request), in arrival order
    rows: list[list[tuple]] = [[] for _ in range(dp)]
    events, outputs = [], []
    t, inp, out, run, idle = 0, 0.0, 0.0, 0.0, dp

    def arrive(r: Req) -> None:
        if batch_prefills:
            held.append(r)
        else:
            _route([r], running, waiting)

    for _ in range(min(clients, len(queue))):
        arrive(queue.popleft())
    while held or any(running) or any(waiting) or delayed:
        release(delayed, t, not (held or any(running) or any(waiting)), arrive)
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
                f, firsts = rank_step(running[k], waiting[k], budget, limit, spec)
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


def _route(rs: list[Req], running: list[list[Req]], waiting: list[deque]) -> None:
    """Each of `rs` to the rank with the fewest pending prompt tokens, then fewest requests in flight, then the
    soonest to free a slot (`play_dp`'s DP scheduler)."""
    keys = [(sum(q.prompt - q.done_prompt for q in rr) + sum(q.prompt for q in w), len(rr) + len(w),
             min((q.output - q.done_output for q in rr), default=0)) for rr, w in zip(running, waiting)]
    for r in rs:
        k = min(range(len(keys)), key=keys.__getitem__)
        waiting[k].append(r)
        pend, n, rem = keys[k]
        keys[k] = (pend + r.prompt, n + 1, rem)


def _decode_run(running: list[list[Req]], rows: list[list[tuple]], k_steps: int, budget: int,
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
        p = play_rank(unit, draw_lengths(prompts, isl, osl, seed + 7919 * r, range_ratio), played_clients, 1,
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
    of every request and the inter-token latencies of every decoded token (`itl`). A benchmark longer than the
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
    ttft, tpot = latencies_of(at, ls.outputs)
    k = ls.requests / ls.played
    if ls.clients > ls.cap + 1:
        ttft += median_queue_wait(ls.clients, ls.cap, ls.requests, ls.played / cum[-1])
    gaps = itl(per_step, np.repeat(np.array([b.decodes for b in ls.batches], dtype=np.float64), ls.counts))
    return SimResult(float(cum[-1]) * k, round(steps * k), round(ls.input_tokens * k), round(ls.output_tokens * k),
                     {n: v * k for n, v in breakdown.items()}, ls.decodes / max(steps, 1), ls.running / max(steps, 1),
                     played=ls.played, requests=ls.requests, median_ttft_s=ttft, median_tpot_s=tpot,
                     median_itl_s=gaps[0], p99_itl_s=gaps[1])
