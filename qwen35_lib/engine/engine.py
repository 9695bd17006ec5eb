"""The serving engine: requests in, tokens out, one jitted ragged step at a time (the step: `engine.step`; the knobs:
`engine.engine_config`; a request checked and its result: `engine.requests`)."""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import time
from collections.abc import Callable, Sequence
from functools import partial

import jax
import numpy as np

from qwen35_lib.config import Config
from qwen35_lib.engine.batch import bucket, pack, stack_ranks
from qwen35_lib.engine.cache import (
    CacheShape,
    cache_shardings,
    copy_rows,
    init_cache,
    step_memory_shortfall,
    step_working_bytes,
)
from qwen35_lib.engine.engine_config import EngineConfig, check_cache_memory
from qwen35_lib.engine.requests import Result, stop_set, validate_request
from qwen35_lib.engine.sampling import SamplingParams, fill_processing_row, processing_arrays
from qwen35_lib.engine.scheduler import RankScheduler, Request, Schedule
from qwen35_lib.engine.speculative import (
    check_speculative,
    draft_step,
    head_inputs,
)
from qwen35_lib.engine.step import TRACES, engine_step, rs_row_tile, verify_step
from qwen35_lib.kernels import registry as kernel_registry
from qwen35_lib.model.decoder import check_weights
from qwen35_lib.model.layer_loop import per_layer_cache, prepare_weights
from qwen35_lib.model.mtp import declare_mtp, mtp_layer_config
from qwen35_lib.parallel.shardings import batch_sharding, shard_weights
from qwen35_lib.plan import SINGLE, ServingPlan


@dataclasses.dataclass
class StepStats:
    steps: int = 0
    traces: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # real new tokens per step
    recomputed: list[int] = dataclasses.field(default_factory=list)  # of those, tokens lost to a preemption before
    seqs: list[int] = dataclasses.field(default_factory=list)  # sequences per step
    mixed_steps: int = 0  # steps with decodes and prefill chunks together
    drafted: int = 0  # speculative decoding: drafts verified, and of those accepted
    accepted: int = 0
    buckets: set = dataclasses.field(default_factory=set)
    # per step, seconds in the jitted step: dispatch (and a compile, when `traces` grew), device, its tokens read
    step_seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def waste(self) -> float:
        """Recomputed tokens over the useful ones (computed once): 0 without preemption."""
        total, again = sum(self.tokens), sum(self.recomputed)
        return again / (total - again) if total > again else 0.0


class Engine:
    """Continuous batching over a paged KV cache and GDN state slots.

        engine = Engine(config, weights, EngineConfig(max_num_seqs=8))            # one device
        engine = Engine(config, weights, ec, mesh=make_mesh(), plan=get_stage("fused_ag"))   # a serving plan
        results = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=16))

    The plan is bound once here (`plan.bind(mesh, config)`: checked against the model on the mesh, each kernel
    slot resolved for its platform; a plan bound to this mesh already is taken as it is) and handed to the jitted
    step (`engine.plan`).

    Or drive it: `add_request(...)`, then `step()` until `has_work` is False; `step()` returns the
    (request id, token) pairs it produced, and finished requests appear in `engine.results`.
    """

    def __init__(self, config: Config, weights: dict, engine_config: EngineConfig | None = None, *, mesh=None,
                 plan: ServingPlan | None = None, mtp_weights: dict | None = None, **knobs):
        check_weights(config, weights)
        ec = engine_config or EngineConfig(**knobs)
        # the one check and binding (the KV dtype: the plan's, else the engine config's)
        plan = (SINGLE if plan is None else plan).bound(mesh, config, kv_dtype=ec.kv_dtype)
        kernel_registry.check_plan(plan)  # a kernel name no slot has: refused here, not at the first step's trace
        check_speculative(plan, ec.speculative_tokens, mtp_weights)
        config = plan.placed(config)  # as bound: tp_kvrep's duplicated KV heads, the plan's GDN state dtype
        self.mesh = None if plan.layout == "single" else mesh
        if self.mesh is not None:  # one rank per data-parallel shard; weights and pools placed by the plan
            dp = plan.dp
            if ec.ranks not in (1, dp):
                raise ValueError(f"EngineConfig.ranks={ec.ranks}, but plan {plan.name!r} on this mesh has {dp} "
                                 "data-parallel ranks: leave ranks at 1 (it is set from the layout)")
            ec = dataclasses.replace(ec, ranks=dp)
            weights = shard_weights(config, plan, weights, mesh)
        self.config, self.plan, self.weights, self.ec = config, plan, weights, ec
        C = config.gdn_chunk_size
        self.chunk = C
        self.decode_buckets = _powers_of_two(min(ec.max_num_seqs, ec.max_num_batched_tokens))
        self.prefill_buckets = (0,) + tuple(C * b for b in _powers_of_two(-(-ec.max_num_batched_tokens // C)))
        self.row_tile = rs_row_tile(plan) if self.mesh is not None else 1
        self.cache_shape = ec.cache_shape(plan)
        check_cache_memory(config, ec, self.cache_shape, self.mesh, plan)  # before a byte is allocated
        self.cache = self._init_cache(config, self.cache_shape)
        self.width = ec.speculative_tokens + 1  # tokens a decode row holds: its last token and its drafts
        self.mtp_weights = self.head_cache = None
        if self.width > 1:  # the MTP head, placed as the plan places a layer, and its own paged KV pool
            lc = mtp_layer_config(config)
            self.mtp_weights = mtp_weights if self.mesh is None else shard_weights(config, plan, mtp_weights, mesh,
                                                                                   declare_mtp)
            # its layer per-layer on XLA:CPU as the model's (`prepare_weights`, once): stacked [1, 1, ...] it ran in
            # a one-group scan whose weight slices XLA:CPU copies, in each of the k draft passes (`model.layer_loop`;
            # the LM head handed over is packed a second time, kept beside the head's layer)
            self.mtp_weights = dict(self.mtp_weights, layers=prepare_weights(lc, dict(
                layers=self.mtp_weights["layers"], lm_head=self.weights["lm_head"]), plan)["layers"])
            self.head_cache = self._init_cache(lc, dataclasses.replace(self.cache_shape, verify=1), per_layer=False)
        self.ranks = [RankScheduler(ec.pages, ec.page_size, ec.max_num_seqs + 1, ec.max_num_seqs,
                                    ec.max_num_batched_tokens, self.prefill_buckets[-1], C) for _ in range(ec.ranks)]
        self.stats = StepStats()
        self.step_fn = engine_step  # the jitted step this engine calls (a stand-in may replace it in tests)
        self.draft_fn = draft_step  # and its drafter, with speculative_tokens > 0 (`engine.speculative.draft_step`)
        self._memory_checked: set[tuple[int, int]] = set()  # buckets whose step's working memory was checked
        self.results: dict[int, Result] = {}
        self._next_id = 0
        self._copy_fn = None  # the jitted `copy_rows` of the forks, built on the first fork

    def _init_cache(self, config: Config, shape: CacheShape, per_layer: bool = True) -> dict:
        if self.mesh is None:  # per-layer pools where the layers run unrolled (`model.layer_loop`)
            cache = init_cache(config, shape)
            return per_layer_cache(config, cache, self.plan) if per_layer else cache
        placed = cache_shardings(config, self.plan, shape, self.mesh)  # each device allocates only its own shards
        return jax.jit(partial(init_cache, config, shape), out_shardings=placed)()

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Bad input is refused here, before it can touch running requests."""
        params = SamplingParams() if params is None else params
        return self._queue(validate_request(self.config, self.ec, prompt_ids, params), params)

    def add_forks(self, prompt_ids: Sequence[int], params: Sequence[SamplingParams]) -> list[int]:
        """Queue one request per `params` on the same prompt (vLLM's `n`); returns their ids. The prompt is
        prefilled once and forked (`engine.scheduler`): the choices share its pages and each samples its own
        tokens. Every request is checked before any is queued."""
        prompt = [validate_request(self.config, self.ec, prompt_ids, p) for p in params][0] if params else []
        if len(params) < 2 or len(prompt) < 2:
            return [self._queue(prompt, p) for p in params]
        first, *rest = [self._request(prompt, p) for p in params]
        first.forks = rest
        self.ranks[first.rank].add(first)
        for f in rest:
            f.rank = first.rank
        return [first.id, *(f.id for f in rest)]

    def _queue(self, prompt: list[int], params: SamplingParams) -> int:
        r = self._request(prompt, params)
        self.ranks[r.rank].add(r)
        return r.id

    def _request(self, prompt: list[int], params: SamplingParams) -> Request:
        rank = min(range(len(self.ranks)), key=lambda i: (self.ranks[i].load, i))
        matcher = None if params.structured is None else params.structured.matcher()
        r = Request(self._next_id, prompt, params, stop_set(self.config, params), rank=rank,
                    arrival=time.perf_counter(), matcher=matcher)
        self._next_id += 1
        return r

    def abort_request(self, request_id: int) -> bool:
        """Drop a queued or running request (between steps): its pages and slot are free for the next step and it
        gives no result. True if it was found."""
        return any(sched.abort(request_id) for sched in self.ranks)

    @property
    def has_work(self) -> bool:
        return any(s.waiting or s.running for s in self.ranks)

    # --- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[tuple[int, int]]:
        schedules = [s.schedule() for s in self.ranks]
        if not any(p.decodes or p.prefills for p in schedules):
            if self.has_work:
                raise RuntimeError("the scheduler made no progress: " + repr([(len(s.waiting), len(s.running))
                                                                              for s in self.ranks]))
            return []
        D, T = self._step_shape(schedules)
        S = self.ec.max_num_seqs
        packs = [pack([w for _, w in p.decodes], [w for _, w in p.prefills], D, T, S, self.ec.pages_per_seq,
                      self.chunk, self.width) for p in schedules]
        tokens, meta = stack_ranks(packs)
        samp = self._sampling_arrays(schedules, S)
        self.stats.buckets.add((D, T))
        traced = TRACES[0]
        with self._on_mesh():
            tokens, meta, samp = jax.tree.map(self._place, (tokens, meta, samp))
            self._check_step_memory(D, T, tokens, meta, samp)
            start = time.perf_counter()
            next_tokens, accepted, drafts = self._forward(schedules, packs, tokens, meta, samp)
        self.stats.step_seconds.append(time.perf_counter() - start)
        self.stats.traces += TRACES[0] - traced
        now = time.perf_counter()
        self._record(schedules)  # before commit: the recomputed count reads the requests' high-water marks
        events = []
        for rank, (sched, schedule) in enumerate(zip(self.ranks, schedules)):
            if drafts is not None:
                self._count_drafts(schedule, accepted[rank])
            kept = None if accepted is None else accepted[rank]
            for r, token in sched.commit(schedule, next_tokens[rank], kept):
                r.token_times.append(now)
                events.append((r.id, token))
                if r.finish_reason:
                    self.results[r.id] = Result(r.id, r.prompt, list(r.output), r.finish_reason, r.arrival,
                                                r.token_times, r.preemptions)
            if drafts is not None:
                self._next_drafts(schedule, drafts[rank])
        self._copy_forked()
        return events

    def _forward(self, schedules: list[Schedule], packs: list, tokens, meta, samp) -> tuple:
        """One step on the device, placed arguments: (next tokens [R, S] ([R, S, V] verified), and with drafts the
        tokens each row keeps [R, S] and the next drafts [R, S, k], else None, None), on the host."""
        weights = self._step_weights()
        if self.width == 1:
            next_tokens, self.cache = self.step_fn(self.config, self.plan, weights, self.cache, tokens, meta, samp)
            return np.asarray(next_tokens.addressable_data(0)), None, None  # replicated on every device
        # verify, accept and roll back, then draft for the next step (`engine.speculative`)
        next_tokens, accepted, self.cache, hidden = verify_step(self.config, self.plan, weights, self.cache, tokens,
                                                                meta, samp)
        ids, src = map(self._place, head_inputs(schedules, packs, self.width))
        drafts, self.head_cache = self.draft_fn(self.config, self.plan, self.width - 1, weights, self.mtp_weights,
                                                self.head_cache, hidden, tokens, meta, next_tokens, accepted, ids,
                                                src)
        return tuple(np.asarray(x.addressable_data(0)) for x in (next_tokens, accepted, drafts))

    def _count_drafts(self, schedule: Schedule, accepted: np.ndarray) -> None:
        for s, (_, w) in enumerate(schedule.decodes):
            self.stats.drafted += len(w.tokens) - 1
            self.stats.accepted += int(accepted[s]) - 1

    def _next_drafts(self, schedule: Schedule, drafts: np.ndarray) -> None:
        """Each row's sequence that emitted a token and runs on takes its drafts for the next step: up to k, and no
        more than its remaining outputs after the next one."""
        for s, (r, _) in enumerate(schedule.items):
            if r.finish_reason is None and r.slot and r.computed == len(r.known) - 1:
                r.drafts = [int(t) for t in drafts[s, :max(0, r.params.max_new_tokens - len(r.output) - 1)]]

    def _copy_forked(self) -> None:
        """The forks' own copies of their prompt's last page and GDN slot (`RankScheduler.copies`), on the device,
        before the next step reads them."""
        if not any(s.copies for s in self.ranks):
            return
        S, R = self.ec.max_num_seqs, len(self.ranks)
        rows = {kind: np.zeros((R, S, 2), np.int32) for kind in ("page", "slot")}  # (0, 0): the null row's own
        for rank, sched in enumerate(self.ranks):
            for kind in rows:
                pairs = [(a, b) for k, a, b in sched.copies if k == kind]
                rows[kind][rank, :len(pairs)] = np.reshape(pairs, (-1, 2))
            sched.copies = []
        if self._copy_fn is None:
            out = None if self.mesh is None else jax.tree.map(lambda x: x.sharding, self.cache)
            self._copy_fn = jax.jit(copy_rows, donate_argnums=0, out_shardings=out)
        with self._on_mesh():
            self.cache = self._copy_fn(self.cache, self._place(rows["page"]), self._place(rows["slot"]))

    def _check_step_memory(self, D: int, T: int, tokens, meta, samp) -> None:
        """A ValueError naming the knobs to lower when the step of bucket (D, T) needs more working memory than
        the devices have left once the caches are placed (on XLA:CPU the step's temporaries grow with the pools:
        the XLA paged attention gathers every sequence's pages). Once per bucket; a stand-in step without `lower`
        is not checked."""
        fn = self.step_fn if self.width == 1 else verify_step  # the step this engine runs
        lower = getattr(fn, "lower", None)
        if lower is None or (D, T) in self._memory_checked:
            return
        key = (fn, self.config, self.plan, self.cache_shape, D, T, self.mesh)  # what the step depends on
        if key not in _STEP_BYTES:  # lowering and memory_analysis: ~0.3 s a bucket even with the compile cached
            lowered = lower(self.config, self.plan, self._step_weights(), self.cache, tokens, meta, samp)
            _STEP_BYTES[key] = step_working_bytes(lowered.compile())
        self._memory_checked.add((D, T))
        devices = self.mesh.devices.flat if self.mesh is not None else [jax.devices()[0]]
        short = step_memory_shortfall(_STEP_BYTES[key], devices)
        if short is not None:
            ec = self.ec
            raise ValueError(f"{short} at {D} decode rows + {T - D} prefill tokens per rank: lower max_model_len "
                             f"({ec.max_model_len}), max_num_seqs ({ec.max_num_seqs}) or max_num_batched_tokens "
                             f"({ec.max_num_batched_tokens})")

    def _step_shape(self, schedules: list[Schedule]) -> tuple[int, int]:
        """The (D, T) bucket of the step of `schedules` (one a rank): `step_shape` of its most loaded rank."""
        return self.step_shape(max(max(len(p.decodes) for p in schedules), 1),
                               max(sum(-(-len(w.tokens) // self.chunk) * self.chunk for _, w in p.prefills)
                                   for p in schedules))

    def step_shape(self, decodes: int, prefill: int) -> tuple[int, int]:
        """The (D, T) bucket of a step of `decodes` decode rows and `prefill` prefill tokens (whole GDN chunks) a
        rank: decode rows, and all rows (decode rows of `width` tokens each + the prefill region).

        1. D: the decode bucket (a power of two), P: the prefill bucket (0 or chunks by powers of two);
        2. where the MoE reduce-scatters each rank's rows over the mesh (`rs_row_tile`), a step with a prefill
           region takes D up to a multiple of the tile, so that T = D + P is one too (P is whole chunks of 64).
        """
        D, P = bucket(max(decodes, 1), self.decode_buckets), bucket(prefill, self.prefill_buckets)
        if P and self.row_tile > 1:
            D = -(-D // self.row_tile) * self.row_tile
        return D, D * self.width + P

    def buckets(self) -> list[tuple[int, int]]:
        """Every (D, T) bucket this engine's step takes (`step_shape` of each decode and prefill bucket)."""
        return sorted({self.step_shape(d, p) for d in self.decode_buckets for p in self.prefill_buckets})

    # --- compiling ahead of a workload ------------------------------------------------------------------------
    def workload_buckets(self, prompt_lengths: Sequence[int], max_new_tokens: int | Sequence[int]
                         ) -> list[tuple[int, int]]:
        """The (D, T) buckets the step takes when requests of these prompt lengths are submitted together (to an
        idle engine) and each generates max_new_tokens (EOS ignored): the scheduler run dry, on its own copies
        (this engine's state is untouched, nothing is computed)."""
        outs = [max_new_tokens] * len(prompt_lengths) if isinstance(max_new_tokens, numbers.Integral) \
            else list(max_new_tokens)
        if len(outs) != len(prompt_lengths):
            raise ValueError(f"{len(prompt_lengths)} prompt lengths but {len(outs)} max_new_tokens: give one per "
                             "prompt, or a single int for all")
        ec, C = self.ec, self.chunk
        ranks = [RankScheduler(ec.pages, ec.page_size, ec.max_num_seqs + 1, ec.max_num_seqs,
                               ec.max_num_batched_tokens, self.prefill_buckets[-1], C) for _ in range(ec.ranks)]
        for i, (n, o) in enumerate(zip(prompt_lengths, outs)):
            validate_request(self.config, ec, [0] * n, SamplingParams(max_new_tokens=o))
            rank = min(range(len(ranks)), key=lambda j: (ranks[j].load, j))
            ranks[rank].add(Request(i, [0] * n, SamplingParams(max_new_tokens=o, ignore_eos=True), frozenset(),
                                    rank=rank))
        seen = []
        while any(s.waiting or s.running for s in ranks):
            schedules = [s.schedule() for s in ranks]
            if not any(p.decodes or p.prefills for p in schedules):
                raise RuntimeError("the scheduler made no progress in the dry run of the workload")
            shape = self._step_shape(schedules)
            if shape not in seen:
                seen.append(shape)
            for sched, schedule in zip(ranks, schedules):
                sched.commit(schedule, [0] * len(schedule.items))
        if self.width > 1:  # drafts: how many tokens a step keeps is the acceptance's, so sequences finish at steps
            # the dry run cannot know and any smaller decode bucket may come (the dry run keeps one token a step)
            top = max(D for D, _ in seen)
            seen += [b for b in (self.step_shape(d, 0) for d in self.decode_buckets if d <= top) if b not in seen]
        return seen

    def precompile(self, prompt_lengths: Sequence[int] | None = None, max_new_tokens: int | Sequence[int] = 1,
                   *, buckets: Sequence[tuple[int, int]] | None = None, processing: bool = False) -> dict:
        """Compile the step for every bucket a workload will use (`workload_buckets`), or for `buckets` (D, T),
        so that running it compiles nothing. Each bucket is compiled by one step of padding only (it writes the
        null page and slot, which no request reads); the engine's stats are untouched.

            engine.precompile([len(p) for p in prompts], 64)   # then engine.generate(prompts, ...)

        `processing=True` compiles the step variant that steps with logits processing (penalties, logit_bias, ...)
        use instead. Returns {"buckets": [(D, T), ...], "compiled": steps traced, "seconds": wall time}."""
        if buckets is None:
            if prompt_lengths is None:
                raise ValueError("precompile needs the workload (prompt_lengths, max_new_tokens) or buckets=[(D, T)]")
            buckets = self.workload_buckets(prompt_lengths, max_new_tokens)
        R, S = self.ec.ranks, self.ec.max_num_seqs
        start, traced = time.perf_counter(), TRACES[0]
        formed = self.buckets()
        for D, T in buckets:
            if (D, T) not in formed:
                raise ValueError(f"bucket (D={D}, T={T}) is not one this engine forms: {formed}")
            schedules = [Schedule([], [])] * R
            packs = [pack([], [], D, T, S, self.ec.pages_per_seq, self.chunk, self.width)] * R
            tokens, meta = stack_ranks(packs)
            samp = self._sampling_arrays(schedules, S)
            if processing:  # the step variant with the [R, S, V] logits-processing arrays (penalties, logit_bias)
                samp["proc"] = self.processing_arrays(R, S)
            with self._on_mesh():
                tokens, meta, samp = jax.tree.map(self._place, (tokens, meta, samp))
                self._check_step_memory(D, T, tokens, meta, samp)
                self._forward(schedules, packs, tokens, meta, samp)  # on the host: done
        return {"buckets": [tuple(b) for b in buckets], "compiled": TRACES[0] - traced,
                "seconds": time.perf_counter() - start}

    def _step_weights(self) -> dict:
        """The weights in the form the step takes (`model.layer_loop.prepare_weights`: per-layer on XLA:CPU)."""
        return prepare_weights(self.config, self.weights, self.plan)

    def _on_mesh(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _place(self, x: np.ndarray):
        """A host array [R, ...] as a global array split over the data-parallel ranks (any process count:
        each process supplies the shards its devices hold, from the same host copy)."""
        if self.mesh is None:
            return x
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, batch_sharding(self.plan, self.mesh, x.ndim),
                                            lambda index: x[index])

    def _sampling_arrays(self, schedules: list[Schedule], S: int) -> dict:
        R = len(schedules)
        arr = dict(temperature=np.zeros((R, S), np.float32), top_k=np.zeros((R, S), np.int32),
                   top_p=np.ones((R, S), np.float32), seed=np.zeros((R, S), np.uint32),
                   position=np.zeros((R, S), np.int32), min_p=np.zeros((R, S), np.float32))
        processed = any(r.params.processed for p in schedules for r, _ in p.items)
        W = self.width  # with drafts, a row of processing a verified position ([R, S, W]: its state after the drafts
        # before it, as vLLM's rejection sampler processes each position)
        if processed:  # the [R, S, vocab] logits-processing path (a second compile of the step, used only when needed)
            arr["proc"] = self.processing_arrays(R, S)
            flat = {k: v.reshape(R * S * W, *v.shape[2 + (W > 1):]) for k, v in arr["proc"].items()}
        for rank, schedule in enumerate(schedules):
            for s, (r, w) in enumerate(schedule.items):
                p = r.params
                arr["temperature"][rank, s], arr["top_k"][rank, s], arr["top_p"][rank, s] = \
                    p.temperature, p.top_k, p.top_p
                arr["seed"][rank, s], arr["min_p"][rank, s] = p.seed, p.min_p
                arr["position"][rank, s] = w.start_pos + len(w.tokens)  # position of the token being sampled
                if processed and p.processed:
                    drafts = list(w.tokens[1:]) if s < len(schedule.decodes) else []  # a decode row: [last, drafts]
                    for j in range(W):  # the outputs before position j: the request's, then drafts 1..j
                        fill_processing_row(flat, (rank * S + s) * W + j, p, r.prompt, r.output + drafts[:j],
                                            sorted(r.stop_ids), r.matcher)
        return arr

    def processing_arrays(self, R: int, S: int) -> dict:
        """Neutral logits-processing arrays of a step (`sampling.processing_arrays`): rows [R, S], or [R, S, W]
        with drafts (one a verified position)."""
        return processing_arrays((R, S) if self.width == 1 else (R, S, self.width), self.config.vocab_size)

    def _record(self, schedules: list[Schedule]) -> None:
        st = self.stats
        st.steps += 1
        st.tokens.append(sum(p.tokens for p in schedules))  # a verified row's drafts included
        st.seqs.append(sum(len(p.decodes) + len(p.prefills) for p in schedules))
        st.mixed_steps += any(p.decodes and p.prefills for p in schedules)
        st.recomputed.append(sum(p.recomputed for p in schedules))

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.ranks)

    # --- convenience ----------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_token: Callable[[int, int], None] | None = None) -> list[Result]:
        """Run `prompts` to completion (with whatever else is queued); results in input order. Every request is
        checked before any is queued: a call that raises leaves nothing behind."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
            raise ValueError(f"prompts is a sequence of prompts (each a sequence of token ids); got "
                             f"{type(prompts).__name__}")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams: give one per prompt, "
                                 "or a single SamplingParams for all")
            each = [SamplingParams() if p is None else p for p in params]
        else:
            each = [SamplingParams() if params is None else params] * len(prompts)
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, each)):
            try:
                checked.append(validate_request(self.config, self.ec, p, sp))
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {i}: {e}") from None
        ids = [self._queue(p, sp) for p, sp in zip(checked, each)]
        while not all(i in self.results for i in ids):
            for rid, token in self.step():
                if on_token:
                    on_token(rid, token)
        return [self.results[i] for i in ids]


def _powers_of_two(n: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return tuple(out) + (n,)


_STEP_BYTES: dict[tuple, int | None] = {}  # (step fn, config, plan, cache shape, D, T, mesh) -> working bytes
