"""Continuous batching: which tokens of which requests go into the next step, and the page/slot bookkeeping.

Pure Python, no JAX. One `RankScheduler` per data-parallel rank owns that rank's free pages and slots, its
waiting queue and its running requests, both in arrival order (request id). Each step (per rank), `schedule()`:
1. decodes every running request whose known tokens are all in the cache but the last, oldest first; one whose
   next token needs a page when none is free preempts the most recently arrived running request (itself, when it
   is the newest: then it is not scheduled), as vLLM's recompute policy does;
2. continues the prompts (prompt + kept outputs, after a preemption) of running requests part-way through
   them, a chunk each (chunked prefill);
3. admits waiting requests in arrival order while a slot, the token budget and the batch allow, unless a
   request was preempted in this step. An admitted request gets the pages of all its known tokens at once, and
   is admitted only while the free pages then left hold as many again, or all that it and the running requests
   can still grow by: the guard against thrashing, where a request is readmitted, recomputed and preempted
   again for every page an older one fills (a victim is recomputed only after the others have filled at least
   as many pages as it holds).
A request preempted in a schedule is in no list of that schedule and cannot be admitted again in it. Preemption frees
its pages and slot and puts it back at the front of the queue with its outputs kept, to be recomputed (prompt +
outputs) when it is admitted again; `commit()` then counts those tokens as recomputed.

Forks (`n` > 1, as vLLM's parallel sampling): the first request of a group carries the others in `forks`; its prompt
is prefilled once, up to its last token, and `commit()` then forks it (`_fork`): each fork shares the prompt's full
pages (counted in `shared`; a page is free again when its last holder lets it go), gets its own copy of the page the
last prompt token writes into and of the GDN state slot (`copies`, which the engine applies on the device before
the next step), and decodes that last token itself, so every choice samples its own first token. A fork that finds
no free slot or page then waits as an ordinary request and prefills its prompt itself.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

from qwen35_lib.engine.batch import SeqWork
from qwen35_lib.engine.sampling import SamplingParams


@dataclasses.dataclass(eq=False)  # compared by identity: two requests are never the same one
class Request:
    id: int  # arrival order
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    rank: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens of prompt + output already in the cache
    high: int = 0  # the most tokens ever in the cache: tokens below it computed again are recomputed
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int = 0  # 0: none
    finish_reason: str | None = None
    preemptions: int = 0
    matcher: Any = None  # structured outputs: this request's grammar matcher (`engine.structured.Matcher`)
    forks: list[Request] = dataclasses.field(default_factory=list)  # the group's other choices, forked at fork_at
    drafts: list[int] = dataclasses.field(default_factory=list)  # speculative tokens the next decode verifies
    # timestamps (time.perf_counter) for the throughput harness
    arrival: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def known(self) -> list[int]:  # every token whose K/V and state the cache must hold before sampling
        return self.prompt + self.output

    @property
    def fork_at(self) -> int:  # prompt tokens computed once for the whole group: all but the last
        return len(self.prompt) - 1


@dataclasses.dataclass
class Schedule:
    """One rank's share of a step: decodes and prefill chunks, as (request, SeqWork)."""

    decodes: list[tuple[Request, SeqWork]]
    prefills: list[tuple[Request, SeqWork]]
    preempted: list[Request] = dataclasses.field(default_factory=list)  # by this schedule, in none of its lists

    @property
    def items(self) -> list[tuple[Request, SeqWork]]:  # in the order of the step's sequence rows
        return self.decodes + self.prefills

    @property
    def tokens(self) -> int:  # a decode's drafts included
        return sum(len(w.tokens) for _, w in self.items)

    @property
    def recomputed(self) -> int:  # scheduled tokens that were in the cache before a preemption (valid until commit)
        return sum(max(0, min(r.high, w.start_pos + len(w.tokens)) - w.start_pos) for r, w in self.items)


class RankScheduler:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_region: int, chunk: int):
        self.page_size, self.chunk = page_size, chunk
        self.max_num_seqs = min(max_num_seqs, num_slots - 1)
        self.budget, self.prefill_region = max_num_batched_tokens, prefill_region
        self.free_pages = deque(range(1, num_pages))  # page 0 is the null page
        self.free_slots = deque(range(1, num_slots))  # slot 0 is the null slot
        self.waiting: deque[Request] = deque()  # in arrival order
        self.running: list[Request] = []  # in arrival order
        self.preemptions = 0
        self.shared: dict[int, int] = {}  # page -> holders beyond the first (forks sharing a prompt's pages)
        self.copies: list[tuple[str, int, int]] = []  # ("page" | "slot", source, destination), for the engine

    @property
    def load(self) -> int:
        return sum(len(r.known) - r.computed for r in self.running) + sum(len(r.known) for r in self.waiting)

    def add(self, r: Request) -> None:
        if self.waiting and self.waiting[-1].id > r.id:
            raise ValueError(f"request {r.id} arrives after request {self.waiting[-1].id}: ids are arrival order")
        self.waiting.append(r)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def schedule(self) -> Schedule:
        schedule = Schedule([], [])
        budget, region = self.budget, self.prefill_region
        for r in list(self.running):  # 1. decodes, oldest first (with their drafts, as the budget allows)
            if budget == 0:
                break
            if r.computed != len(r.known) - 1:
                continue
            new = r.known[r.computed:] + r.drafts[:budget - 1]
            if not self._room_for_decode(r, schedule, len(new)):
                break  # r preempted itself: it was the newest, no one after it is running
            schedule.decodes.append((r, SeqWork(new, r.computed, list(r.pages), r.slot)))
            budget -= len(new)
        for r in self.running:  # 2. prompt chunks of running requests
            if r.computed < len(r.known) - 1 and budget > 0 and region >= self.chunk:
                budget, region = self._add_chunk(schedule, r, budget, region)
        while not schedule.preempted and self.waiting and budget > 0 and region >= self.chunk and self.free_slots \
                and len(self.running) < self.max_num_seqs:  # 3. admissions
            r = self.waiting[0]
            need = self._pages_for(len(r.known))
            if not self._admissible(r, need):
                break  # wait: no room now, or too little for it to grow before it is preempted again
            self.waiting.popleft()
            r.slot = self.free_slots.popleft()
            r.pages = [self.free_pages.popleft() for _ in range(need)]
            bisect.insort(self.running, r, key=lambda q: q.id)
            budget, region = self._add_chunk(schedule, r, budget, region)
        return schedule

    def _admissible(self, r: Request, need: int) -> bool:
        """Room for r's `need` pages, and after them either as many again or all that r and the running requests
        can still grow by (then no preemption can follow; a pool sized for max_num_seqs full requests never
        waits here)."""
        free = len(self.free_pages)
        if need > free or not self.running:
            return need <= free
        growth = sum(self._growth(q) for q in self.running) + self._growth(r) - need
        return free - need >= min(need, growth)

    def _growth(self, r: Request) -> int:  # pages r may still take: its last token is sampled, never written
        return max(0, self._pages_for(len(r.prompt) + r.params.max_new_tokens - 1) - len(r.pages))

    def _room_for_decode(self, r: Request, schedule: Schedule, tokens: int = 1) -> bool:
        """Pages for r's next `tokens` tokens (its drafts too) where it needs them, preempting the newest running
        requests; False when r itself was preempted."""
        while self._pages_for(r.computed + tokens) > len(r.pages):
            while not self.free_pages:
                victim = self.running[-1]
                assert all(victim is not q for q, _ in schedule.items), "a victim is newer than every scheduled request"
                self.preempt(victim)
                schedule.preempted.append(victim)
                if victim is r:
                    return False
            r.pages.append(self.free_pages.popleft())
        return True

    def _add_chunk(self, schedule: Schedule, r: Request, budget: int, region: int) -> tuple[int, int]:
        end = r.fork_at if r.forks else len(r.known)  # a group's prompt stops before its last token, to fork there
        n = min(end - r.computed, budget, region)
        assert self._pages_for(r.computed + n) <= len(r.pages), "a prompt's pages are given at admission"
        schedule.prefills.append((r, SeqWork(r.known[r.computed : r.computed + n], r.computed, list(r.pages), r.slot)))
        return budget - n, region - -(-n // self.chunk) * self.chunk

    def preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.release(r)
        r.computed = 0
        r.drafts = []  # drafted from a state that is gone
        r.preemptions += 1
        self.preemptions += 1
        bisect.insort(self.waiting, r, key=lambda q: q.id)  # at the front, unless a fork waits alone before it

    def abort(self, request_id: int) -> bool:
        """Drop a waiting or running request between steps, freeing its pages and slot; True if it was here. Its
        forks not yet forked wait on as ordinary requests."""
        for r in [*self.waiting, *self.running]:
            for f in r.forks:
                if f.id == request_id:
                    r.forks.remove(f)
                    f.finish_reason = "abort"
                    return True
            if r.id == request_id:
                for f in r.forks:
                    self._wait_alone(f)
                r.forks = []
                if r in self.running:
                    self.finish(r, "abort")
                else:
                    self.waiting.remove(r)
                    r.finish_reason = "abort"
                return True
        return False

    def _wait_alone(self, f: Request) -> None:
        bisect.insort(self.waiting, f, key=lambda q: q.id)

    def _fork(self, r: Request) -> None:
        """r's prompt is in the cache but its last token: each fork takes r's full pages shared, a copy of the page
        the last token writes into and of r's GDN slot, and is running from there; one without room waits alone."""
        at = r.fork_at
        k, partial = divmod(at, self.page_size)
        for f in r.forks:
            if not (self.free_slots and self.free_pages and len(self.running) < self.max_num_seqs):
                self._wait_alone(f)
                continue
            f.slot, page = self.free_slots.popleft(), self.free_pages.popleft()
            f.pages = r.pages[:k] + [page]
            for p in r.pages[:k]:
                self.shared[p] = self.shared.get(p, 0) + 1
            if partial:
                self.copies.append(("page", r.pages[k], page))
            self.copies.append(("slot", r.slot, f.slot))
            f.computed = f.high = at
            bisect.insort(self.running, f, key=lambda q: q.id)
        r.forks = []

    def release(self, r: Request) -> None:
        for p in r.pages:  # a shared page goes back to the pool with its last holder
            if self.shared.get(p):
                self.shared[p] -= 1
                if not self.shared[p]:
                    del self.shared[p]
            else:
                self.free_pages.append(p)
        r.pages = []
        if r.slot:
            self.free_slots.append(r.slot)
            r.slot = 0

    def commit(self, schedule: Schedule, sampled: Sequence, accepted: Sequence[int] | None = None
               ) -> list[tuple[Request, int]]:
        """Apply a step: `sampled[s]` is the token sampled after row s of `schedule.items`. Returns the (request,
        token) pairs that became outputs; a request that then finished has its `finish_reason` set and is gone.
        With drafts verified (`accepted` given, `engine.speculative`): `sampled[s]` [V] holds the target's token after
        each of row s's tokens, and a decode row keeps `accepted[s]` of its tokens (its last one and the accepted
        drafts) and outputs as many: the accepted drafts (equal to the target's) and the target's next token, up
        to a stop token or max_new_tokens."""
        events = []
        for s, (r, w) in enumerate(schedule.items):
            assert r.computed == w.start_pos, "a schedule is committed once, right after it is made"
            verified = accepted is not None and s < len(schedule.decodes)
            r.computed += int(accepted[s]) if verified else len(w.tokens)
            r.high = max(r.high, r.computed)
            r.drafts = []
            if r.forks and r.computed == r.fork_at:
                self._fork(r)
            if verified:  # the kept drafts are outputs, then the target's token after the last kept one
                new = sampled[s][:int(accepted[s])]
            elif r.computed == len(r.known):  # all known tokens are in: the sample is the next output
                new = [sampled[s] if accepted is None else sampled[s][0]]
            else:
                continue
            for token in map(int, new):
                r.output.append(token)
                events.append((r, token))
                if token in r.stop_ids:
                    self.finish(r, "eos")
                    break
                if len(r.output) >= r.params.max_new_tokens:
                    self.finish(r, "length")
                    break
        return events

    def finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        self.running.remove(r)
        self.release(r)
