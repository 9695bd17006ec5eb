"""The engine loop: one background thread owns the `Engine` and does continuous batching across every open HTTP
request.

1. HTTP handlers (asyncio) `submit` a request: a command goes on a thread-safe queue, with a `Sink` (the
   handler's asyncio queue and the choice index) that will receive its events;
2. the thread, between steps, drains the commands: `add_request` for a submission (its ValueError goes back to
   the sink as an error, the engine untouched), an abort for a request whose client went away;
3. it runs `engine.step()` while any request is queued or running, and hands each (request, token) to its sink;
   a finished request's `Result` follows its last token;
4. when nothing is left it sleeps until the next command.
The engine is touched only by this thread, so no lock is needed around it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import traceback
from typing import Any

from qwen35_lib.engine import Engine, SamplingParams


@dataclasses.dataclass(eq=False)
class Sink:
    """Where a request's events go: `(index, kind, value)` on an asyncio queue of the handler's event loop, with
    kind "token" (an id), "done" (the engine's Result) or "error" (a message)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0
    request_id: int | None = None  # set by the engine thread once added

    def put(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, kind, value))


class EngineLoop:
    """`EngineLoop(engine).start()`; `submit(prompt_ids, params, sink)`, `abort(sink)`; `stop()`."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}  # engine request id -> sink
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qwen35-engine-loop", daemon=True)
        self.error: str | None = None  # set if a step raised: the loop stops and /health reports it
        self.aborted = 0

    # --- called from any thread ------------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        self._commands.put(("add", prompt_ids, params, sink))
        self._wake.set()

    def abort(self, sink: Sink) -> None:
        self._commands.put(("abort", sink))
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self) -> dict:
        """Pool occupancy, summed over ranks (read without a lock: a snapshot for /health and tests)."""
        e = self.engine
        return dict(running=sum(len(s.running) for s in e.ranks), waiting=sum(len(s.waiting) for s in e.ranks),
                    free_pages=sum(len(s.free_pages) for s in e.ranks), total_pages=e.ec.ranks * (e.ec.pages - 1),
                    steps=e.stats.steps, traces=e.stats.traces, preemptions=e.preemptions, aborted=self.aborted)

    # --- the engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain()
            if not self.engine.has_work:
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
                sink.put("token", token)
                if result is not None:
                    sink.put("done", result)
                    del self._sinks[rid]

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, prompt, params, sink = cmd
                try:
                    sink.request_id = self.engine.add_request(prompt, params)
                except ValueError as e:  # refused before it touched the pools
                    sink.put("error", str(e))
                    continue
                self._sinks[sink.request_id] = sink
            else:
                sink = cmd[1]
                rid = sink.request_id
                if rid is not None and self._sinks.pop(rid, None) is not None:
                    self.aborted += self.engine.abort_request(rid)
