"""Throughput from a simulation of the scheduler, not from one step.

`simulate(step_fn, ...)` plays a closed-loop benchmark (the InferenceX protocol: `concurrency` clients, each
sending its next request when the last one ends, `num_prompts` in all, lengths uniform in [0.8 L, L], seeded)
against one data-parallel rank; ranks are balanced, so the slice does `dp` times the rank's work per step.
Each step, as the engine's scheduler (qwen35_lib/engine/scheduler.py) and vLLM's do:
1. every running request past its prompt decodes one token;
2. requests part-way through their prompt continue with the next chunk, within the token budget;
3. waiting requests are admitted while the budget, `max_seqs` and the memory cap (`max_running`) allow.
A request finishes after its output length; a new one arrives at once while prompts remain. The step's time is
`step_fn(batch)` for the whole-slice `ops.Batch`. Runs of pure-decode steps (no prompt work anywhere) are
advanced together: k steps at the time of their middle step (exact when step time is linear in the context).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable

import numpy as np

from qwen35_lib.costmodel.ops import Batch


@dataclasses.dataclass
class _Req:
    prompt: int
    output: int
    done_prompt: int = 0
    done_output: int = 0


@dataclasses.dataclass(frozen=True)
class SimResult:
    seconds: float
    steps: int
    input_tokens: int
    output_tokens: int
    breakdown: dict[str, float]  # component -> seconds over the run
    mean_decode_batch: float  # decodes per step (whole slice), averaged over steps
    mean_running: float  # sequences per rank, averaged over steps

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def draw_lengths(n: int, isl: int, osl: int, seed: int = 0, range_ratio: float = 0.8) -> list[tuple[int, int]]:
    """(input, output) lengths uniform in [ceil(r L), L] (data/workloads.json's convention), seeded."""
    rng = np.random.default_rng(seed)
    lo_i, lo_o = max(1, int(np.ceil(range_ratio * isl))), max(1, int(np.ceil(range_ratio * osl)))
    return list(zip(rng.integers(lo_i, isl + 1, n).tolist(), rng.integers(lo_o, osl + 1, n).tolist()))


def simulate(step_fn: Callable[[Batch], tuple[float, dict[str, float]]], isl: int, osl: int, concurrency: int,
             dp: int, max_batched_tokens: int, max_seqs: int, max_running: int, num_prompts: int | None = None,
             seed: int = 0) -> SimResult:
    """Play the benchmark on one rank (see the module doc). `step_fn(batch) -> (seconds, breakdown)`.

    `concurrency` clients over the slice (concurrency / dp per rank); `max_seqs` and `max_running` (memory)
    bound the running sequences per rank; `max_batched_tokens` is the rank's token budget per step.
    """
    clients = max(1, round(concurrency / dp))
    prompts = max(clients, round((num_prompts or 2 * concurrency) / dp))
    lengths = draw_lengths(prompts, isl, osl, seed)
    limit = max(1, min(max_seqs, max_running))
    waiting: deque[_Req] = deque(_Req(i, o) for i, o in lengths[:clients])
    pending = deque(_Req(i, o) for i, o in lengths[clients:])
    running: list[_Req] = []
    t = 0.0
    steps = 0
    breakdown: dict[str, float] = {}
    dec_sum = run_sum = 0.0
    while waiting or running:
        prompt_work = bool(waiting) and len(running) < limit or any(r.done_prompt < r.prompt for r in running)
        decoders = [r for r in running if r.done_prompt == r.prompt]
        if not prompt_work:  # 1'. a run of pure-decode steps until the first request ends
            k = min(r.output - r.done_output for r in decoders)
            ctx = [r.prompt + r.done_output + (k + 1) / 2 for r in decoders]  # middle of the run
            batch = Batch(decodes=len(decoders) * dp, decode_ctx=float(np.mean(ctx)),
                          max_ctx=int(max(ctx) + k / 2))
            sec, parts = step_fn(batch)
            for r in decoders:
                r.done_output += k
            n_steps = k
            dec_sum += k * len(decoders) * dp
        else:  # 1-3. one mixed step
            budget = max_batched_tokens
            n_dec = min(len(decoders), budget)
            ctx = [r.prompt + r.done_output + 1 for r in decoders[:n_dec]]
            for r in decoders[:n_dec]:
                r.done_output += 1
            budget -= n_dec
            chunks: list[tuple[int, int]] = []  # (tokens, cached before)
            for r in running:
                if r.done_prompt < r.prompt and budget > 0:
                    n = min(r.prompt - r.done_prompt, budget)
                    chunks.append((n, r.done_prompt))
                    r.done_prompt += n
                    budget -= n
            while waiting and budget > 0 and len(running) < limit:
                r = waiting.popleft()
                running.append(r)
                n = min(r.prompt, budget)
                chunks.append((n, 0))
                r.done_prompt += n
                budget -= n
            for r in running:  # the step that completes a prompt samples the first output token
                if r.done_prompt == r.prompt and r.done_output == 0 and any(c[1] + c[0] == r.prompt for c in chunks):
                    r.done_output = 1
            pre = sum(c[0] for c in chunks)
            max_ctx = max([c[0] + c[1] for c in chunks] + ctx + [0])
            batch = Batch(decodes=n_dec * dp, decode_ctx=float(np.mean(ctx)) if ctx else 0.0,
                          prefill_tokens=pre * dp, prefill_seqs=len(chunks) * dp,
                          prefill_ctx=float(np.mean([c[1] for c in chunks])) if chunks else 0.0, max_ctx=max_ctx)
            sec, parts = step_fn(batch)
            n_steps = 1
            dec_sum += n_dec * dp
        t += sec * n_steps
        steps += n_steps
        run_sum += len(running) * n_steps
        for name, v in parts.items():
            breakdown[name] = breakdown.get(name, 0.0) + v * n_steps
        for r in [r for r in running if r.done_output >= r.output]:  # finished: the client sends its next
            running.remove(r)
            if pending:
                waiting.append(pending.popleft())
    inp, out = sum(i for i, _ in lengths), sum(o for _, o in lengths)  # every request runs to its end
    return SimResult(t, steps, inp * dp, out * dp, breakdown, dec_sum / max(steps, 1), run_sum / max(steps, 1))

