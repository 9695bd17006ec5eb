"""Continuous batching: which tokens of which requests go into the next step, and the page/slot bookkeeping.

Pure Python, no JAX. One `RankScheduler` per data-parallel rank owns that rank's free pages and slots.
Each step (per rank):
1. every running request whose known tokens are all in the cache decodes one token;
2. requests part-way through their prompt continue with the next chunk (chunked prefill);
3. waiting requests are admitted in arrival order while a slot, the token budget and the batch allow.
Pages are allocated for exactly the tokens a step writes. When a running request needs a page and none is free,
the most recently admitted other request is preempted: its pages and slot are freed and it goes back to the
front of the queue with its outputs kept, to be recomputed (prompt + outputs) when it is admitted again.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from qwen35_lib.engine.batch import SeqWork
from qwen35_lib.engine.sampling import SamplingParams


@dataclasses.dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    rank: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens of prompt + output already in the cache
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int = 0  # 0: none
    finish_reason: str | None = None
    preemptions: int = 0
    # timestamps (time.perf_counter) for the throughput harness
    arrival: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def known(self) -> list[int]:  # every token whose K/V and state the cache must hold before sampling
        return self.prompt + self.output


@dataclasses.dataclass
class Plan:
    """One rank's share of a step: decodes and prefill chunks, as (request, SeqWork)."""

    decodes: list[tuple[Request, SeqWork]]
    prefills: list[tuple[Request, SeqWork]]

    @property
    def tokens(self) -> int:
        return len(self.decodes) + sum(len(w.tokens) for _, w in self.prefills)


class RankScheduler:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_region: int, chunk: int):
        self.page_size, self.chunk = page_size, chunk
        self.max_num_seqs = min(max_num_seqs, num_slots - 1)
        self.budget, self.prefill_region = max_num_batched_tokens, prefill_region
        self.free_pages = deque(range(1, num_pages))  # page 0 is the null page
        self.free_slots = deque(range(1, num_slots))  # slot 0 is the null slot
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0

    @property
    def load(self) -> int:
        return sum(len(r.known) - r.computed for r in self.running) + sum(len(r.known) for r in self.waiting)

    def _pages_needed(self, r: Request, new_tokens: int) -> int:
        return -(-(r.computed + new_tokens) // self.page_size) - len(r.pages)

    def _grow(self, r: Request, new_tokens: int) -> bool:
        """Give `r` pages for `new_tokens` more tokens, preempting newer requests if needed."""
        need = self._pages_needed(r, new_tokens)
        while need > len(self.free_pages):
            victims = [v for v in self.running if v is not r]
            if not victims:
                return False
            self.preempt(victims[-1])
        r.pages += [self.free_pages.popleft() for _ in range(max(need, 0))]
        return True

    def preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.release(r)
        r.computed = 0
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    def release(self, r: Request) -> None:
        self.free_pages.extend(r.pages)
        r.pages = []
        if r.slot:
            self.free_slots.append(r.slot)
            r.slot = 0

    def plan(self) -> Plan:
        plan = Plan([], [])
        budget, region = self.budget, self.prefill_region
        for r in list(self.running):  # 1. decodes
            if r not in self.running or r.computed < len(r.known) - 1 or budget == 0:
                continue
            if self._grow(r, 1):
                plan.decodes.append((r, SeqWork(r.known[r.computed:], r.computed, list(r.pages), r.slot)))
                budget -= 1
        for r in list(self.running):  # 2. prompt chunks of running requests
            if r in self.running and r.computed < len(r.known) - 1 and budget > 0 and region >= self.chunk:
                budget, region = self._add_chunk(plan, r, budget, region)
        while self.waiting and budget > 0 and region >= self.chunk and self.free_slots and \
                len(self.running) < self.max_num_seqs:  # 3. admissions
            r = self.waiting[0]
            if self._pages_needed(r, min(len(r.known), budget, region)) > len(self.free_pages):
                break  # no room without preempting a running request: wait
            self.waiting.popleft()
            r.slot = self.free_slots.popleft()
            self.running.append(r)
            budget, region = self._add_chunk(plan, r, budget, region)
        keep = lambda items: [(r, w) for r, w in items if r in self.running]  # drop requests preempted meanwhile
        return Plan(keep(plan.decodes), keep(plan.prefills))

    def _add_chunk(self, plan: Plan, r: Request, budget: int, region: int) -> tuple[int, int]:
        n = min(len(r.known) - r.computed, budget, region)
        if not self._grow(r, n):
            return budget, region
        plan.prefills.append((r, SeqWork(r.known[r.computed : r.computed + n], r.computed, list(r.pages), r.slot)))
        return budget - n, region - -(-n // self.chunk) * self.chunk

    def finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        self.running.remove(r)
        self.release(r)
