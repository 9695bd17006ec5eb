"""The choices of one generation request while they run: each choice's engine events into its text (`Run`),
gathered into one response (`collect`, then `choice`) or streamed as server-sent events (`stream`); a client that
goes away aborts its unfinished engine requests, which frees their pages and slots."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from qwen35_lib.engine.requests import stop_set
from qwen35_lib.serve import parsers, responses, scoring, structured
from qwen35_lib.serve.loop import EngineLoop, Sink
from qwen35_lib.serve.output import ChoiceOutput
from qwen35_lib.serve.protocol import APIError
from qwen35_lib.serve.request import Parsed
from qwen35_lib.serve.responses import FINISH


class Gone(Exception):
    """The client closed the connection before its answer was ready: nobody to answer."""


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is read, so `receive` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


class Run:
    """The choices of one HTTP request (an engine request each, or none: echo with max_tokens 0): their outputs,
    metrics, and the event each becomes."""

    def __init__(self, loop: EngineLoop, sinks: list[Sink | None], events: asyncio.Queue, parsed: Parsed,
                 text: Any, metrics: Any, t0: float):
        self.loop, self.sinks, self.events, self.parsed, self.metrics, self.t0 = \
            loop, sinks, events, parsed, metrics, t0
        self.text = text
        self.outs = [ChoiceOutput(text, parsed.stop, parsed.include_stop_str_in_output, parsed.skip_special_tokens)
                     for _ in sinks]
        self.last = [0.0] * len(sinks)
        self.stops = [frozenset() if sp is None else stop_set(loop.engine.config, sp)
                      for sp in parsed.params]  # the tokens that end each choice (the engine's rule)
        # index -> (finish_reason, stop_reason); a choice with nothing to generate is done from the start
        self.finish: dict[int, tuple[str, str | int | None]] = {i: ("length", None)
                                                                for i, s in enumerate(sinks) if s is None}

    @property
    def pending(self) -> bool:
        return len(self.finish) < len(self.sinks)

    def prompt_text(self, index: int) -> str:
        """The prompt of a choice as text (`echo`): decoded from its ids; "" without a tokenizer."""
        return self.text.decode(self.parsed.prompt_of(index), skip_special_tokens=False) if self.text else ""

    async def next(self) -> tuple[int, str | None, list[int]] | None:
        """The next (index, text piece, token ids) of an unfinished choice; a choice that finishes has its entry
        in `finish` when this returns; None for an event of an already finished choice."""
        index, kind, value = await self.events.get()
        if index in self.finish:
            return None  # a choice cut by a stop string: the rest of its engine request is dropped
        out, m, now = self.outs[index], self.metrics, time.perf_counter()
        if kind == "token":
            if m is not None:
                (m.ttft.observe(now - self.t0) if not out.ids else m.token_gap(now - self.last[index]))
                m.generation_tokens.inc()
            self.last[index] = now
            piece = out.push(value, stops=value in self.stops[index])
            if out.stopped is not None:
                self._done(index, "stop", out.stopped)
                self.loop.abort(self.sinks[index])
            return index, piece, [value]
        if kind == "done":
            piece = out.finish()
            last = value.output_ids[-1] if value.output_ids else None
            # vLLM: a stop token of the request's own names itself in stop_reason; the model's EOS gives None
            reason = last if value.finish_reason == "eos" and last in self.parsed.stop_ids else None
            self._done(index, FINISH[value.finish_reason], reason)
            return index, piece, []
        raise APIError(value, status=500 if self.loop.error else 400)

    def _done(self, index: int, finish: str, reason: str | int | None) -> None:
        self.finish[index] = (finish, reason)
        if self.metrics is not None:
            self.metrics.e2e.observe(time.perf_counter() - self.t0)
            self.metrics.finished(finish)

    def abort_rest(self) -> None:
        for i, s in enumerate(self.sinks):
            if s is not None and i not in self.finish:
                self.loop.abort(s)
                self.finish[i] = ("abort", None)
                if self.metrics is not None:
                    self.metrics.finished("abort")


async def collect(run: Run, request: Request) -> None:
    """Every choice to its end; `Gone` if the client goes away first (its engine requests aborted)."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while run.pending:
            get = asyncio.ensure_future(run.next())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:  # the client went away: nobody to answer; `finally` frees the pages
                get.cancel()
                raise Gone()
            get.result()
    finally:
        gone.cancel()
        run.abort_rest()


async def stream(run: Run, rid: str, model: str) -> AsyncIterator[str]:
    chat, parsed = run.parsed.chat, run.parsed
    split = [parsers.ReasoningStream() for _ in run.sinks] if parsed.reasoning else None
    forced = [parsers.ForcedToolStream(parsed.forced_tool) for _ in run.sinks] if parsed.forced_tool else None
    tools = [parsers.ToolCallStream() for _ in run.sinks] if parsed.tools else None
    try:
        for i in range(len(run.sinks)):
            if chat:
                yield _sse(responses.chunk(rid, model, True, i, "", [], None, role=True))
            elif parsed.echo or run.sinks[i] is None:  # the prompt first (echo); a choice with nothing to generate
                finish = "length" if run.sinks[i] is None else None
                yield _sse(responses.chunk(rid, model, False, i, run.prompt_text(i) if parsed.echo else "", [],
                                          finish))
        while run.pending:
            try:
                item = await run.next()
            except APIError as e:
                yield _sse(e.body())
                return
            if item is None:
                continue
            index, piece, ids = item
            finish, reason = run.finish.get(index, (None, None))
            thought = None
            if split is not None:  # reasoning before </think>, content after
                thought, piece = split[index].push(piece or "", final=finish is not None)
                thought = thought if parsed.include_reasoning else None
                piece = piece or None
            calls = None
            if forced is not None:  # the answer is the calls' JSON: sent as tool-call deltas, not content
                calls, piece = forced[index].push(piece or ""), None
                if finish is not None and forced[index].calls and parsed.forced_tool == "required":
                    finish = "tool_calls"
            if tools is not None:  # content before the first <tool_call>, each call once its block closes
                piece, calls = tools[index].push(piece or "", final=finish is not None)
                finish = "tool_calls" if finish is not None and tools[index].calls else finish
                piece = piece or None
            if finish is not None and not ids:
                piece = piece or (None if chat else "")
            yield _sse(responses.chunk(rid, model, chat, index, piece, ids, finish, stop_reason=reason,
                                      reasoning=thought, tool_calls=calls))
        if parsed.include_usage:
            use = responses.usage(sum(map(len, parsed.prompts)), sum(len(o.ids) for o in run.outs))
            yield _sse(responses.usage_chunk(rid, model, chat, use))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the stream was cancelled) or an error ended it: free what is left
        run.abort_rest()


def choice(run: Run, i: int, text: Any, scores: scoring.Scores | None) -> dict:
    """Choice i of a finished request: its text (after the prompt with `echo`), log-probabilities, and the chat
    message's reasoning and tool calls."""
    parsed, chat, o = run.parsed, run.parsed.chat, run.outs[i]
    prompt = parsed.prompt_of(i)
    body = (run.prompt_text(i) if parsed.echo else "") + o.text
    lp = plp = None
    if parsed.logprobs is not None:
        ids, k = prompt + o.ids, parsed.logprobs
        if chat:
            lp = scoring.chat_logprobs(text, ids, scores, len(prompt), k)
        else:
            start = 0 if parsed.echo else len(prompt)
            lp = scoring.completion_logprobs(text, ids, scores, start, k, first_none=parsed.echo)
    if parsed.prompt_logprobs is not None and not chat:
        plp = scoring.prompt_logprobs(text, prompt, scores, parsed.prompt_logprobs)
    finish, reason = run.finish[i]
    content, message = chat_message(parsed, body) if chat else (body, None)
    if message and message.get("tool_calls") and (parsed.forced_tool in (None, "required")):
        finish = "tool_calls"  # vLLM: auto and required calls end so; a named function's answer ends "stop"
    return responses.choice(i, chat, content, o.ids, finish, reason, logprobs=lp, prompt_logprobs=plp,
                            message=message)


def chat_message(parsed: Parsed, text: str) -> tuple[str | None, dict]:
    """A chat answer's content and the rest of its message: the reasoning (--reasoning-parser) and tool calls."""
    extra: dict = {}
    content: str | None = text
    if parsed.reasoning:
        reasoning, content = parsers.split_reasoning(text)
        if parsed.include_reasoning:
            extra["reasoning_content"] = extra["reasoning"] = reasoning
    if parsed.tools:
        content, calls = parsers.split_tool_calls(content or "")
        extra["tool_calls"] = calls
    elif parsed.forced_tool is not None:  # the answer is the calls' JSON (structured outputs: `tool_schema`)
        content, calls = structured.forced_tool_calls(content, parsed.forced_tool)
        extra["tool_calls"] = calls
    return content, extra
