"""What every play of the serving benchmark shares (`schedule` plays one rank, `lockstep` the ranks together):
the request (`Req`) and its drawn lengths, speculative decoding's rows (`Speculation`), one step of one rank's
scheduler (`rank_step`: the steps 1-3 of `schedule`'s module doc), the admission lag (`ADMISSION_LAG`, `release`),
the queue wait of clients beyond what runs (`median_queue_wait`), the latencies `vllm bench serve` reports
(`latencies`, `itl`) and what a play returns (`SimResult`). A step's time comes from a `StepsFn`."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(slots=True)
class Req:
    prompt: int
    output: int
    done_prompt: int = 0
    done_output: int = 0
    arrived: float | None = 0.0  # seconds into the run the client sent it (None: running before the run began)
    first: float = 0.0  # its first output token (the end of the step that completed its prompt)


def latencies(done: list[tuple[float | None, float, float, int]]) -> tuple[float, float]:
    """(median time to first token, median time per output token after the first) over finished requests
    (arrived, first, finished, output), as `vllm bench serve` reports them; NaN when none qualifies."""
    kept = [d for d in done if d[0] is not None]
    return latencies_of(np.array([d[:3] for d in kept], dtype=np.float64).reshape(-1, 3),
                         np.array([d[3] for d in kept], dtype=np.int64))


def latencies_of(times: np.ndarray, outputs: np.ndarray) -> tuple[float, float]:
    """`latencies` of requests that all arrived in the run, as arrays: times [n, 3] (arrived, first, finished),
    outputs [n] (`price` holds them so: a 1k/8k play finishes thousands)."""
    many = outputs > 1
    ttft = float(np.median(times[:, 1] - times[:, 0])) if len(times) else float("nan")
    tpot = float(np.median((times[many, 2] - times[many, 1]) / (outputs[many] - 1))) if many.any() else float("nan")
    return ttft, tpot


def itl(per_step: np.ndarray, decodes: np.ndarray) -> tuple[float, float]:
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
    median_itl_s: float = float("nan")  # inter-token latency over every decoded token: its step's time (`itl`)
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


def median_queue_wait(clients: int, cap: int, prompts: int, rate: float) -> float:
    """Median wait in the queue before admission, beyond the steady run's (whose queue holds at most one), of a
    benchmark of `prompts` requests from `clients` clients at most `cap` of which run, completing `rate` requests
    per second: the first `clients` arrive together and the i-th waits for i - cap completions; each later one
    arrives as one finishes, behind the `clients - cap - 1` already queued."""
    arrived_first = min(clients, prompts)

    def waits(i: int) -> int:  # the i-th smallest wait (completions waited for): the first arrivals' are ascending
        return max(i - cap, 0) if i < arrived_first else max(clients - cap - 1, 0)  # and at most the later ones'

    return (waits((prompts - 1) // 2) + waits(prompts // 2)) / 2 / rate  # the median, in closed form


ADMISSION_LAG = ("vLLM's engine core drains its input queue once a loop, then schedules; with --async-scheduling "
                 "(a batch queue of 2) it schedules step i + 1 before step i's outputs are read, so a request sent "
                 "on step i's outputs reaches a schedule only after step i + 1 ends and runs from step i + 3: 2 steps "
                 "after the simulation's i + 1 (1 step without async scheduling: it runs from step i + 2)")


def release(delayed: deque, t: int, idle: bool, admit: Callable[[Req], None]) -> None:
    """Hand `admit` each delayed request the scheduler sees after `t` steps; all of them when the engine is `idle`
    (no step in flight: a request is scheduled as it arrives)."""
    while delayed and (idle or delayed[0][0] <= t):
        admit(delayed.popleft()[1])


def rank_step(running: list[Req], waiting: deque, budget: int, limit: int, spec: Speculation = NO_SPEC
               ) -> tuple[tuple, list[Req]]:
    """One step of one rank's scheduler (`schedule`'s module doc, 1-3): its batch fields (decodes, decode ctx, prompt
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
    chunked: list[Req] = []  # in running order
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
