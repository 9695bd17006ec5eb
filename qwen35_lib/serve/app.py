"""The HTTP routes (FastAPI): `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`.

A generation request:
1. body parsed and checked (`protocol.parse`, then the engine's own `validate_request` per prompt), all before
   the engine sees it: a bad request is answered 4xx with the OpenAI error shape and never reaches the pools;
2. one engine request per prompt submitted to the `EngineLoop`, whose events come back on an asyncio queue;
3. not streamed: tokens gathered until every prompt is done, then one response with `usage`; streamed: one
   server-sent event per token (text from an incremental detokenizer), a final event per choice with its
   `finish_reason`, a `usage` event if `stream_options.include_usage`, then `data: [DONE]`;
4. a client that goes away (the stream cancelled, or `http.disconnect` while waiting) aborts its unfinished
   engine requests, which frees their pages and slots.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from qwen35_lib.engine.engine import validate_request
from qwen35_lib.serve import protocol
from qwen35_lib.serve.loop import EngineLoop, Sink
from qwen35_lib.serve.protocol import FINISH, APIError


def make_app(loop: EngineLoop, model_name: str, text: Any = None) -> FastAPI:
    """The FastAPI app over a started `EngineLoop`; `text` (a `qwen35_lib.text.Text`) enables text prompts,
    text outputs and chat."""
    engine = loop.engine
    created = int(time.time())
    app = FastAPI(title="qwen35_lib serve", description="OpenAI-compatible server over the qwen35_lib engine")

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return JSONResponse(protocol.error_body(str(e.detail), e.status_code), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        return JSONResponse(protocol.error_body(str(e), 400), status_code=400)

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse(protocol.error_body(loop.error or "the engine loop is not running", 503),
                                status_code=503)
        return {"status": "ok", **loop.stats()}

    @app.get("/v1/models")
    async def models():
        card = dict(id=model_name, object="model", created=created, owned_by="qwen35_lib", root=model_name,
                    parent=None, max_model_len=engine.ec.max_model_len)
        return {"object": "list", "data": [card]}

    async def generate(request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        if isinstance(body, dict) and body.get("model") not in (None, model_name):
            raise APIError(f"the model `{body['model']}` does not exist; this server serves `{model_name}` "
                           "(GET /v1/models)", "model", status=404)
        parsed = protocol.parse(body, text, chat, engine.ec.max_model_len)
        for p, sp in zip(parsed.prompts, parsed.params):
            try:
                validate_request(engine.config, engine.ec, p, sp)
            except ValueError as e:
                raise APIError(str(e), "messages" if chat else "prompt") from None
        if not loop.alive:
            raise APIError(loop.error or "the engine loop is not running", status=503)
        events: asyncio.Queue = asyncio.Queue()
        sinks = [Sink(asyncio.get_running_loop(), events, i) for i in range(len(parsed.prompts))]
        for p, sp, sink in zip(parsed.prompts, parsed.params, sinks):
            loop.submit(p, sp, sink)
        rid = protocol.new_id(chat)
        if parsed.stream:
            return StreamingResponse(_stream(loop, sinks, events, parsed, rid, model_name, text),
                                     media_type="text/event-stream")
        return await _collect(loop, sinks, events, parsed, rid, model_name, text, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is read, so `receive` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


def _failure(loop: EngineLoop, message: str) -> APIError:
    return APIError(message, status=500 if loop.error else 400)


async def _collect(loop: EngineLoop, sinks: list[Sink], events: asyncio.Queue, parsed: protocol.Parsed, rid: str,
                   model: str, text: Any, request: Request) -> dict:
    results: dict[int, Any] = {}
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while len(results) < len(sinks):
            get = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:  # the client went away: nobody to answer; `finally` frees the pages
                get.cancel()
                return {}
            index, kind, value = get.result()
            if kind == "done":
                results[index] = value
            elif kind == "error":
                raise _failure(loop, value)
    finally:
        gone.cancel()
        for s in sinks:
            if s.index not in results:
                loop.abort(s)
    choices = [protocol.choice(i, parsed.chat, text.decode(r.output_ids) if text else "", r.output_ids,
                               FINISH[r.finish_reason]) for i, r in sorted(results.items())]
    use = protocol.usage(sum(map(len, parsed.prompts)), sum(len(r.output_ids) for r in results.values()))
    return protocol.response(rid, model, parsed.chat, choices, use)


async def _stream(loop: EngineLoop, sinks: list[Sink], events: asyncio.Queue, parsed: protocol.Parsed, rid: str,
                  model: str, text: Any) -> AsyncIterator[str]:
    chat = parsed.chat
    detok = [text.detokenizer() if text else None for _ in sinks]
    outputs = [0] * len(sinks)
    pending = set(range(len(sinks)))
    try:
        if chat:
            for i in pending:
                yield _sse(protocol.chunk(rid, model, True, i, "", [], None, role=True))
        while pending:
            index, kind, value = await events.get()
            if kind == "token":
                outputs[index] += 1
                piece = detok[index].push(value) if detok[index] else ""
                yield _sse(protocol.chunk(rid, model, chat, index, piece, [value], None))
            elif kind == "done":
                pending.discard(index)
                tail = detok[index].flush() if detok[index] else ""
                yield _sse(protocol.chunk(rid, model, chat, index, tail or (None if chat else ""), [],
                                          FINISH[value.finish_reason]))
            else:
                e = _failure(loop, value)
                yield _sse(e.body())
                return
        if parsed.include_usage:
            yield _sse(protocol.usage_chunk(rid, model, chat, protocol.usage(sum(map(len, parsed.prompts)),
                                                                             sum(outputs))))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the stream was cancelled) or an error ended it: free what is left
        for i in pending:
            loop.abort(sinks[i])
