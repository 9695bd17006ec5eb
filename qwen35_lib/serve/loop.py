"""The engine loop: one background thread owns the `Engine` and does continuous batching across every open HTTP
request.

1. HTTP handlers (asyncio) `submit` a request: a command goes on a thread-safe queue, with a `Sink` (the
   handler's asyncio queue and the choice index) that will receive its events;
2. the thread first compiles the step for the shapes it was given (`warmup`: (D, T, with logits processing);
   `ready` turns true after, and /health answers "starting" until then); the shapes of `background` are then
   compiled by a thread of their own (`_compile_background`, smallest first) while the engine serves: a step of a
   shape compiled already never waits, one whose shape is being compiled waits for that compile (never compiles it
   a second time beside it), any other compiles on first use as before. The engine thread then loops: between
   steps it drains at most `max_adds_per_step` commands (`add_forks` for a submission: its choices on one prompt,
   prefilled once; a ValueError goes back to the sinks as an error with the engine untouched; an abort for a
   request whose client went away), so a request with thousands of prompts delays running streams by a bounded
   amount, not by all its prompts;
3. it runs `engine.step()` while any request is queued or running, and hands each (request, token) to its sink;
   a finished request's `Result` follows its last token;
4. every `log_interval_s` it logs throughput and queue stats (vLLM's line); when nothing is left it sleeps
   until the next command.
The engine is touched only by this thread, so no lock is needed around it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from qwen35_lib.engine import Engine, SamplingParams
from qwen35_lib.engine.batch import pack, stack_ranks
from qwen35_lib.engine.sampling import processing_arrays
from qwen35_lib.engine.scheduler import Schedule

log = logging.getLogger("qwen35_lib.serve")


@dataclasses.dataclass(eq=False)
class Sink:
    """Where a request's events go: `(index, kind, value)` on an asyncio queue of the handler's event loop, with
    kind "token" (an id), "done" (the engine's Result) or "error" (a message)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0
    request_id: int | None = None  # set by the engine thread once added

    def put(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, kind, value))
        except RuntimeError:  # the handler's event loop is closed (server shutting down): nobody to tell
            pass


class EngineLoop:
    """`EngineLoop(engine).start()`; `submit(prompt_ids, params, sink)`, `abort(sink)`; `stop()`."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05, *, warmup: Sequence[tuple[int, int, bool]] = (),
                 background: Sequence[tuple[int, int, bool]] = (), max_adds_per_step: int = 64,
                 log_interval_s: float = 0.0, on_compiled: Any = None, on_ready: Any = None):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.warmup = list(warmup)
        self.background = [s for s in background if s not in set(self.warmup)]
        self.compiled_in_background = 0  # background shapes compiled so far
        self._compiler = threading.Thread(target=self._compile_background, name="qwen35-compile", daemon=True)
        self._steps: _WaitingStep | None = None
        self.on_compiled = on_compiled  # called (on a loop thread) once the warm-up and background compiles are done
        self.on_ready = on_ready  # called on the engine thread once the warm-up is done (/health ok)
        self.max_adds_per_step = max_adds_per_step
        self.log_interval_s = log_interval_s  # 0: no periodic stats line
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}  # engine request id -> sink
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qwen35-engine-loop", daemon=True)
        self.error: str | None = None  # set if a step raised: the loop stops and /health reports it
        self.ready = False  # the warm-up compiles are done
        self.warmed = 0  # buckets compiled so far
        self.aborted = 0
        self.generated = 0  # output tokens handed to sinks
        self.prompt_tokens = 0  # prompt tokens of requests added
        self._idle_logged = False

    # --- called from any thread ------------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        if self.background:  # the engine's step waits for a shape the background thread is compiling
            self._steps = _WaitingStep(self.engine.step_fn, self.engine)
            self.engine.step_fn = self._steps
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        self.submit_forks(prompt_ids, [params], [sink])

    def submit_forks(self, prompt_ids: list[int], params: Sequence[SamplingParams], sinks: Sequence[Sink]) -> None:
        """Choices on one prompt (`n`), a sink each: the engine prefills the prompt once and forks it."""
        self._commands.put(("add", prompt_ids, list(params), list(sinks)))
        self._wake.set()

    def abort(self, sink: Sink) -> None:
        self._commands.put(("abort", sink))
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self) -> dict:
        """Pool occupancy, summed over ranks (read without a lock: a snapshot for /health, /metrics and tests)."""
        e = self.engine
        return dict(running=sum(len(s.running) for s in e.ranks), waiting=sum(len(s.waiting) for s in e.ranks),
                    free_pages=sum(len(s.free_pages) for s in e.ranks), total_pages=e.ec.ranks * (e.ec.pages - 1),
                    steps=e.stats.steps, traces=e.stats.traces, preemptions=e.preemptions, aborted=self.aborted)

    # --- the engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._warm()
        except Exception as e:  # a bucket that cannot compile (memory): the server cannot serve it
            self.error = f"warm-up failed: {type(e).__name__}: {e}"
            traceback.print_exc()
            return
        if self.on_ready is not None and self.ready:
            self.on_ready()
        if self.background and not self._stopping.is_set():
            self._compiler.start()
        elif self.on_compiled is not None:
            self.on_compiled()
        last_log, last = time.perf_counter(), (0, 0)
        while not self._stopping.is_set():
            more = self.drain()
            now = time.perf_counter()
            if self.log_interval_s and now - last_log >= self.log_interval_s:
                last, last_log = self._log_stats(now - last_log, last), now
            if not self.engine.has_work:
                if not more:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # the engine's state is unknown now: fail every open request and stop
                self.error = f"engine step failed: {type(e).__name__}: {e}"
                traceback.print_exc()
                for sink in self._sinks.values():
                    sink.put("error", self.error)
                self._sinks.clear()
                return
            for rid, token in events:
                result = self.engine.results.pop(rid, None)  # popped even when aborted meanwhile: nothing is kept
                sink = self._sinks.get(rid)
                if sink is None:
                    continue
                self.generated += 1
                sink.put("token", token)
                if result is not None:
                    sink.put("done", result)
                    del self._sinks[rid]

    def _warm(self) -> None:
        start = time.perf_counter()
        for i, (D, T, processing) in enumerate(self.warmup):
            if self._stopping.is_set():
                return
            self.engine.precompile(buckets=[(D, T)], processing=processing)
            self.warmed = i + 1
            log.warning("warm-up: compiled step shape %d/%d (D=%d, T=%d%s), %.1f s so far", i + 1, len(self.warmup),
                        D, T, ", logits processing" if processing else "", time.perf_counter() - start)
        self.ready = True

    def _compile_background(self) -> None:
        """Compile each background shape (the jitted step's own cache: the engine's later dispatch of that shape
        finds it compiled), logging progress; a shape that fails is left to compile on first use."""
        start, steps = time.perf_counter(), self._steps
        for D, T, processing in self.background:
            if self._stopping.is_set():
                return
            key = steps.claim(D, T, processing)
            if key is None:  # the engine compiled it on first use meanwhile
                continue
            try:
                steps.compile(D, T, processing)
                self.compiled_in_background += 1
                log.info("background compile: step shape (D=%d, T=%d%s) ready, %d/%d, %.1f s so far", D, T,
                         ", logits processing" if processing else "", self.compiled_in_background,
                         len(self.background), time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001 - it compiles on first use instead (and fails there, visibly)
                log.warning("background compile of step shape (D=%d, T=%d) failed: %s: %s", D, T, type(e).__name__,
                            e)
            finally:
                steps.release(key)
        log.warning("background compile: %d step shapes ready in %.1f s", self.compiled_in_background,
                    time.perf_counter() - start)
        if self.on_compiled is not None and not self._stopping.is_set():
            self.on_compiled()

    def _log_stats(self, seconds: float, last: tuple[int, int]) -> tuple[int, int]:
        """vLLM's periodic line: prompt and generation throughput since the last one, queue, KV pages."""
        s = self.stats()
        prompt, gen = self.prompt_tokens - last[0], self.generated - last[1]
        used = 100 * (1 - s["free_pages"] / max(s["total_pages"], 1))
        idle = not (prompt or gen or s["running"] or s["waiting"])
        if idle and self._idle_logged:  # one line when the server goes idle, then quiet until work comes
            return self.prompt_tokens, self.generated
        self._idle_logged = idle
        log.warning("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
                    "Waiting: %d reqs, KV cache usage: %.1f%%, Preemptions: %d", prompt / seconds, gen / seconds,
                    s["running"], s["waiting"], used, s["preemptions"])
        return self.prompt_tokens, self.generated

    def drain(self) -> bool:
        """Apply up to `max_adds_per_step` commands; True if more are waiting."""
        for _ in range(self.max_adds_per_step):
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return False
            if cmd[0] == "add":
                _, prompt, params, sinks = cmd
                try:
                    ids = self.engine.add_forks(prompt, params)
                except ValueError as e:  # refused before it touched the pools
                    for sink in sinks:
                        sink.put("error", str(e))
                    continue
                self.prompt_tokens += len(prompt)
                for sink, rid in zip(sinks, ids):
                    sink.request_id = rid
                    self._sinks[rid] = sink
            else:
                sink = cmd[1]
                rid = sink.request_id
                if rid is not None and self._sinks.pop(rid, None) is not None:
                    self.aborted += self.engine.abort_request(rid)
        return not self._commands.empty()


def _shape_key(tokens, meta, samp) -> tuple:
    """What selects a compiled step: the shapes of its arrays and whether logits processing is on."""
    return tuple(np.shape(x) for x in jax.tree.leaves((tokens, meta))) + ("proc" in samp,)


class _WaitingStep:
    """The engine's `step_fn`, except that a step (or the memory check's `lower`) of a shape the background thread
    is compiling waits for that compile, then runs from the compiled cache."""

    def __init__(self, step, engine: Engine):
        self.step, self.engine = step, engine
        self._lock = threading.Lock()
        self._pending: dict[tuple, threading.Event] = {}
        self._seen: set[tuple] = set()  # shapes compiled (or being compiled) by either thread
        # the cache's shapes, read once here: the engine thread replaces (donates) the arrays at every step
        self._cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                   engine.cache)

    def _wait(self, tokens, meta, samp) -> None:
        key = _shape_key(tokens, meta, samp)
        with self._lock:
            event = self._pending.get(key)
            self._seen.add(key)
        if event is not None:
            event.wait()

    def __call__(self, cfg, plan, weights, cache, tokens, meta, samp):
        self._wait(tokens, meta, samp)
        return self.step(cfg, plan, weights, cache, tokens, meta, samp)

    def lower(self, cfg, plan, weights, cache, tokens, meta, samp):
        self._wait(tokens, meta, samp)
        return self.step.lower(cfg, plan, weights, cache, tokens, meta, samp)

    def _args(self, D: int, T: int, processing: bool):
        """A step of padding only at bucket (D, T), as `Engine.precompile` builds it."""
        e = self.engine
        R, S = e.ec.ranks, e.ec.max_num_seqs
        tokens, meta = stack_ranks([pack([], [], D, T, S, e.ec.pages_per_seq, e.chunk)] * R)
        samp = e._sampling_arrays([Schedule([], [])] * R, S)
        if processing:
            samp["proc"] = processing_arrays((R, S), e.config.vocab_size)
        return tokens, meta, samp

    def claim(self, D: int, T: int, processing: bool) -> tuple | None:
        """Mark a shape as being compiled; None if either thread has it already."""
        key = _shape_key(*self._args(D, T, processing))
        with self._lock:
            if key in self._seen:
                return None
            self._seen.add(key)
            self._pending[key] = threading.Event()
        return key

    def release(self, key: tuple) -> None:
        with self._lock:
            event = self._pending.pop(key)
        event.set()

    def compile(self, D: int, T: int, processing: bool) -> None:
        e = self.engine
        with e._on_mesh():
            tokens, meta, samp = jax.tree.map(e._place, self._args(D, T, processing))
            self.step.lower(e.config, e.plan, e._step_weights(), self._cache, tokens, meta, samp).compile()
