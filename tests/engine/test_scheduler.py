"""The scheduler's invariants under random traffic (pure Python: no model, sampled tokens drawn at random).

Every step, on every rank: no request is scheduled twice (nor one preempted by the schedule), every scheduled chunk is
the next tokens of its request from `computed` on and fits its pages and writes none that forks share, no page
is held by more live requests than share it, no slot by two, and none is lost, the schedule fits the budget and the
batch; a commit advances `computed` by exactly the tokens scheduled (forks start at their group's prompt); every
request finishes with the outputs it asked for.
"""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from qwen35_lib.engine.sampling import SamplingParams
from qwen35_lib.engine.scheduler import RankScheduler, Request

STOP = 0  # the stop token of requests that have one; sampled tokens are drawn from range(VOCAB)
VOCAB = 12


def make_ranks(n: int, num_pages: int, page_size: int, max_num_seqs: int, budget: int, chunk: int):
    region = chunk * -(-budget // chunk)  # as the engine sizes it: its largest prefill bucket
    return [RankScheduler(num_pages, page_size, max_num_seqs + 1, max_num_seqs, budget, region, chunk)
            for _ in range(n)]


def check_rank(s: RankScheduler, schedule, num_pages: int, num_slots: int) -> None:
    items = schedule.items
    assert len({id(r) for r, _ in items}) == len(items), "a request scheduled twice"
    assert not {id(r) for r in schedule.preempted} & {id(r) for r, _ in items}, "a preempted request scheduled"
    assert all(any(r is q for q in s.running) for r, _ in items), "a scheduled request is not running"
    assert len(items) <= s.max_num_seqs and schedule.tokens <= s.budget
    assert sum(-(-len(w.tokens) // s.chunk) * s.chunk for _, w in schedule.prefills) <= s.prefill_region
    for i, (r, w) in enumerate(items):
        n = len(w.tokens)
        assert n >= 1 and w.start_pos == r.computed and w.tokens == r.known[r.computed : r.computed + n]
        if i < len(schedule.decodes):
            assert n == 1 and r.computed == len(r.known) - 1
        assert w.pages == r.pages and len(r.pages) * s.page_size >= w.start_pos + n
        assert w.slot == r.slot != 0
        written = r.pages[w.start_pos // s.page_size : (w.start_pos + n - 1) // s.page_size + 1]
        assert not any(s.shared.get(p) for p in written), "a step writes a page that forks share"
    held = Counter(p for r in s.running for p in r.pages)
    assert all(k == 1 + s.shared.get(p, 0) for p, k in held.items()) and set(s.shared) <= set(held), "page counts"
    assert sorted([*held, *s.free_pages]) == list(range(1, num_pages)), "pages lost or duplicated"
    slots = [r.slot for r in s.running]
    assert sorted(slots + list(s.free_slots)) == list(range(1, num_slots)), "slots lost or duplicated"
    assert all(not r.pages and r.slot == 0 and r.computed == 0 for r in s.waiting)
    assert [r.id for r in s.running] == sorted(r.id for r in s.running)
    assert len(s.running) <= s.max_num_seqs


def simulate(ranks, requests, arrivals, rng, num_pages, num_slots, check=True) -> tuple[int, int]:
    """Run to completion; returns (tokens computed, of them recomputed)."""
    order = sorted(range(len(requests)), key=lambda i: (arrivals[i], i))
    useful = sum(len(r.prompt) + r.params.max_new_tokens for r in requests)
    computed = again = step = k = shared = 0
    next_id = 0
    while k < len(order) or any(s.waiting or s.running for s in ranks):
        assert step <= max(arrivals) + 10 * useful + 10, "requests do not finish"
        while k < len(order) and arrivals[order[k]] <= step:
            r = requests[order[k]]
            for q in (r, *r.forks):  # ids are arrival order, a group's consecutive
                q.id, next_id = next_id, next_id + 1
            s = min(ranks, key=lambda q: q.load)  # the engine's rank choice
            s.add(r)
            k += 1
        schedules = [s.schedule() for s in ranks]
        scheduled = [r for p in schedules for r, _ in p.items]
        assert len({id(r) for r in scheduled}) == len(scheduled), "a request scheduled on two ranks"
        for s, schedule in zip(ranks, schedules):
            if check:
                check_rank(s, schedule, num_pages, num_slots)
            assert schedule.items or not (s.waiting or s.running), "a rank with work scheduled nothing"
            computed, again = computed + schedule.tokens, again + schedule.recomputed
            before = {id(r): r.computed for r in s.running}
            events = s.commit(schedule, [rng.randrange(VOCAB) for _ in schedule.items])
            forked = [r for r in s.running if id(r) not in before and not any(r is q for q, _ in schedule.items)]
            shared += sum(r.computed for r in forked)  # forks running from their group's prompt, never computed
            for r, w in schedule.items:
                assert r.computed == before.pop(id(r)) + len(w.tokens)
            assert all(r.computed == before[id(r)] for r in s.running if id(r) in before), "unscheduled moved"
            for r, token in events:
                assert r.output[-1] == token and r.computed == len(r.known) - 1
        step += 1
    for r in [q for g in requests for q in (g, *g.forks_of)]:
        assert r.finish_reason == ("eos" if STOP in r.stop_ids and r.output[-1] == STOP else "length")
        assert len(r.output) == r.params.max_new_tokens or r.finish_reason == "eos"
        assert STOP not in r.output[:-1] or STOP not in r.stop_ids
    for s in ranks:
        assert sorted(s.free_pages) == list(range(1, num_pages)) and sorted(s.free_slots) == list(range(1, num_slots))
    everyone = [q for r in requests for q in (r, *r.forks_of)]
    assert computed - again + shared == sum(len(r.prompt) + len(r.output) - 1 for r in everyone), "miscounted"
    return computed, again


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_scheduler_invariants(data):
    draw = data.draw
    page_size = draw(st.sampled_from([1, 2, 4, 8, 16]), label="page_size")
    max_model_len = draw(st.integers(2, 80), label="max_model_len")
    pages_per_seq = -(-max_model_len // page_size)
    num_pages = 1 + pages_per_seq + draw(st.integers(0, 2 * pages_per_seq), label="spare pages")  # few
    max_num_seqs = draw(st.integers(1, 6), label="max_num_seqs")
    budget = draw(st.integers(1, 128), label="budget")
    chunk = draw(st.sampled_from([1, 4, 8, 64]), label="chunk")
    ranks = make_ranks(draw(st.integers(1, 3), label="ranks"), num_pages, page_size, max_num_seqs, budget, chunk)
    n = draw(st.integers(1, 24), label="requests")
    requests, arrivals = [], []
    for _ in range(n):
        p = draw(st.integers(1, max_model_len - 1))
        sp = SamplingParams(max_new_tokens=draw(st.integers(1, max_model_len - p)))
        stop = frozenset({STOP}) if draw(st.booleans()) else frozenset()
        prompt = [random.Random(p).randrange(VOCAB) for _ in range(p)]
        requests.append(Request(0, prompt, sp, stop))
        if p > 1:  # n choices: forks of the first (vLLM's parallel sampling)
            requests[-1].forks = [Request(0, prompt, sp, stop) for _ in range(draw(st.integers(0, 3)))]
        requests[-1].forks_of = list(requests[-1].forks)  # the forks list empties when they fork
        arrivals.append(draw(st.integers(0, 40)))
    simulate(ranks, requests, arrivals, random.Random(draw(st.integers(0, 2**32 - 1))), num_pages, max_num_seqs + 1)


def test_no_thrashing_at_200_requests_20_pages_budget_8():
    """Computed tokens stay within 2x the useful ones (computed once) under heavy pressure: 20 pages of 16 tokens
    (one request of at most 304), a budget of 8, 8 sequences; long prompts, then long outputs."""
    for seed, (pmax, omax) in enumerate([(150, 100), (5, 300), (30, 200)]):
        rng = random.Random(seed)
        requests = []
        for _ in range(200):
            p = rng.randint(1, pmax)
            requests.append(Request(0, [1] * p, SamplingParams(max_new_tokens=rng.randint(1, min(omax, 304 - p))),
                                    frozenset()))
            requests[-1].forks_of = []
        ranks = make_ranks(1, 20, 16, 8, 8, 64)
        computed, again = simulate(ranks, requests, [0] * 200, rng, 20, 9, check=False)
        assert ranks[0].preemptions > 10  # the pressure is real
        assert computed <= 2 * (computed - again), (pmax, omax, computed, again)
