"""The HTTP routes (FastAPI): `/v1/completions`, `/v1/chat/completions`, `/v1/models[/{id}]`, `/health`, `/ping`,
`/version`, `/metrics` (Prometheus), `/tokenize`, `/detokenize`.

A generation request:
1. the body is read on the event loop, refused (400 naming --max-request-bytes) as soon as it is longer than the
   server allows; then parsed and checked on a worker thread (JSON, `protocol.parse` with its bounds and the
   tokenizer, the engine's own `validate_request` per prompt), so no request's parsing or tokenizing stalls the
   event loop and the other streams: a bad request is answered 4xx with the OpenAI error shape and never reaches
   the pools; any failure while parsing is the input's (400), never a 500;
2. one engine request per prompt submitted to the `EngineLoop`, whose events come back on an asyncio queue;
3. each token goes through the choice's `ChoiceOutput` (text, stop strings); not streamed: gathered until every
   choice is done, then one response with `usage`; streamed: one server-sent event per token, a final event per
   choice with its `finish_reason`, a `usage` event if `stream_options.include_usage`, then `data: [DONE]`;
   a choice ended by a stop string aborts its engine request;
4. a client that goes away (the stream cancelled, or `http.disconnect` while waiting) aborts its unfinished
   engine requests, which frees their pages and slots; one that goes while its request is still being parsed is
   not waited for, and nothing of it is submitted;
5. structured outputs (`response_format`, `structured_outputs`, `guided_*`: `serve.structured`) are compiled with
   the parse, on its thread (llguidance; a compiled grammar is cached by its spec), and each choice's engine request
   masks its logits by its own matcher of that grammar (`engine.structured`);
6. log-probabilities (`logprobs`, `prompt_logprobs`) are computed once a choice is done, by a scoring forward over
   its prompt and output (`scoring.Scorer`) on a thread of their own.
With `api_key`, every /v1 route needs `Authorization: Bearer KEY` (401 otherwise), as vLLM's --api-key. A body must
be JSON (`Content-Type: application/json`, or none): a web page's form or text/plain post is refused (415), so a
page in a browser cannot make a local server generate.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from qwen35_lib.engine import SamplingParams
from qwen35_lib.engine.engine import stop_set, validate_request
from qwen35_lib.serve import parsers, protocol, scoring, structured
from qwen35_lib.serve.loop import EngineLoop, Sink
from qwen35_lib.serve.output import ChoiceOutput
from qwen35_lib.serve.protocol import FINISH, APIError, Limits
from qwen35_lib.versions import library_version

log = logging.getLogger("qwen35_lib.serve")


class _Gone(Exception):
    """The client closed the connection before its answer was ready: nobody to answer."""


def make_app(loop: EngineLoop, model_name: str, text: Any = None, limits: Limits | None = None,
             api_key: str | None = None) -> FastAPI:
    """The FastAPI app over a started `EngineLoop`; `text` (a `qwen35_lib.text.Text`) enables text prompts,
    text outputs and chat; `limits` bounds a request (default: `Limits` at the engine's max_model_len);
    `api_key`: the key every /v1 request must bear."""
    engine = loop.engine
    limits = limits or Limits(max_model_len=engine.ec.max_model_len)
    if not limits.eos_token_ids:  # stop_token_ids add to these
        limits = dataclasses.replace(limits, eos_token_ids=tuple(engine.config.eos_token_ids))
    created = int(time.time())
    app = FastAPI(title="qwen35_lib serve", description="OpenAI-compatible server over the qwen35_lib engine")
    if api_key:
        app.add_middleware(_ApiKey, key=api_key)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="qwen35-parse")
    score_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen35-score")
    grammars = structured.Grammars(text, engine.config.vocab_size, limits.eos_token_ids)  # structured outputs
    scorer: list = []  # the Scorer, made on first use (its compiles are paid only by requests that ask for logprobs)

    def score(ids: list[int]) -> scoring.Scores:
        if not scorer:
            scorer.append(scoring.Scorer(engine, limits.max_logprobs))
        return scorer[0].score(ids)
    try:
        from qwen35_lib.serve.metrics import Metrics

        metrics: Any = Metrics(loop, model_name)
    except ImportError:
        metrics = None

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return JSONResponse(protocol.error_body(str(e.detail), e.status_code), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        return JSONResponse(protocol.error_body(str(e), 400), status_code=400)

    @app.exception_handler(_Gone)
    async def _gone(_, e: _Gone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def _server_error(_, e: Exception):  # a bug of ours: still the OpenAI shape
        return JSONResponse(protocol.error_body(f"internal error: {type(e).__name__}: {e}", 500), status_code=500)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def off_loop_unless_gone(request: Request, fn, *args):
        """`fn(*args)` on the parse pool; if the client goes away first, `_Gone` at once (a job not yet started is
        cancelled; one running is bounded by the request limits and its result dropped)."""
        job = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not job.done():
            job.cancel()
            raise _Gone()
        return job.result()

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse(protocol.error_body(loop.error or "the engine loop is not running", 503),
                                status_code=503)
        if not loop.ready:
            return JSONResponse({"status": "starting", "warmed_buckets": loop.warmed,
                                 "warmup_buckets": len(loop.warmup)}, status_code=503)
        return {"status": "ok", **loop.stats()}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def get_version():
        return {"version": library_version()}

    @app.get("/metrics")
    async def get_metrics():
        if metrics is None:
            raise APIError("metrics need prometheus_client: pip install 'qwen35-playbook[serve]'", status=503)
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return dict(id=model_name, object="model", created=created, owned_by="qwen35_lib", root=model_name,
                    parent=None, max_model_len=engine.ec.max_model_len)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(f"the model `{model_id}` does not exist; this server serves `{model_name}`", "model",
                           status=404)
        return card()

    def read_json(raw: bytes) -> Any:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise APIError(f"the request body is not valid JSON: {str(e)[:200]}") from None
        protocol.check_sizes(body, limits)  # before the walk over every value
        protocol.check_body(body, limits)
        m = body.get("model")
        if m is not None and m != model_name:
            raise APIError(f"the model `{str(m)[:100]}` does not exist; this server serves `{model_name}` "
                           "(GET /v1/models)", "model", status=404)
        return body

    def guarded(fn):
        """`fn(raw)` on the worker thread: every failure is the input's, answered 4xx."""
        def run(raw: bytes):
            try:
                return fn(read_json(raw))
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 - not a known refusal, but caused by this body
                log.exception("request refused after an unexpected error while parsing it")
                raise APIError(f"the request could not be processed: {type(e).__name__}: {str(e)[:200]}") from None
        return run

    def parse_generation(chat: bool):
        def fn(body: dict) -> protocol.Parsed:
            parsed = protocol.parse(body, text, chat, limits)
            spec = structured.parse_spec(body, limits)
            if spec is not None:  # compiled here, on the parse thread: a bad schema is a 400 naming its field
                grammar = grammars.compile(spec)
                marker = structured.reasoning_marker(text, parsed.prompts[0]) if parsed.reasoning else None
                if marker is not None:  # the reasoning is free, the answer after </think> follows the grammar
                    grammar = grammar.after(marker)
                parsed.params = [None if sp is None else dataclasses.replace(sp, structured=grammar)
                                 for sp in parsed.params]
            for i, sp in enumerate(parsed.params):  # a choice with nothing to generate: its prompt checked
                try:
                    validate_request(engine.config, engine.ec, parsed.prompt_of(i), sp or SamplingParams(1))
                except ValueError as e:
                    raise APIError(str(e), _param_of_engine_error(str(e), chat)) from None
            return parsed
        return guarded(fn)

    parse_chat, parse_completion = parse_generation(True), parse_generation(False)

    async def generate(request: Request, chat: bool):
        t0 = time.perf_counter()
        raw = await _read_body(request, limits.max_request_bytes, limits.read_timeout_s)
        parsed = await off_loop_unless_gone(request, parse_chat if chat else parse_completion, raw)
        if parsed.scored and engine.mesh is not None:
            name = "logprobs" if parsed.logprobs is not None else "prompt_logprobs"
            raise APIError(f"`{name}` is computed under --layout single only; drop it or serve with --layout single",
                           name)
        if not loop.alive:
            raise APIError(loop.error or "the engine loop is not running", status=503)
        events: asyncio.Queue = asyncio.Queue()
        sinks = [None if sp is None else Sink(asyncio.get_running_loop(), events, i)
                 for i, sp in enumerate(parsed.params)]
        for j, prompt in enumerate(parsed.prompts):  # a prompt's n choices forked from one prefill
            group = [i for i in range(j * parsed.n, (j + 1) * parsed.n) if sinks[i] is not None]
            if group:
                loop.submit_forks(prompt, [parsed.params[i] for i in group], [sinks[i] for i in group])
        if metrics is not None:
            metrics.prompt_tokens.inc(sum(map(len, parsed.prompts)))
        run = _Run(loop, sinks, events, parsed, text, metrics, t0)
        rid = protocol.new_id(chat, parsed.request_id)
        if parsed.stream:
            return StreamingResponse(_stream(run, rid, model_name), media_type="text/event-stream")
        await _collect(run, request)
        return await _respond(run, rid, model_name, score if parsed.scored else None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    def need_text():
        if text is None:
            raise APIError("this server has no tokenizer (start it with --tokenizer DIR)")

    def tokenize(body: dict) -> dict:
        need_text()
        if body.get("messages") is not None:
            ids = protocol.chat_prompt(body, text, limits)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError("`prompt` must be a string (or send `messages`)", "prompt")
            protocol.chars_ok(len(prompt), limits, "prompt")
            ids = protocol.encode(text, prompt, protocol.get(body, "add_special_tokens", (bool,), True))
        return {"count": len(ids), "max_model_len": engine.ec.max_model_len, "tokens": ids, "token_strs": None}

    def detokenize(body: dict) -> dict:
        need_text()
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(protocol.is_int(t) and 0 <= t < text.vocab_size for t in ids):
            raise APIError(f"`tokens` must be a list of token ids in [0, {text.vocab_size})", "tokens")
        return {"prompt": text.decode(ids)}

    tokenize_guarded, detokenize_guarded = guarded(tokenize), guarded(detokenize)

    @app.post("/tokenize")
    async def post_tokenize(request: Request):
        raw = await _read_body(request, limits.max_request_bytes, limits.read_timeout_s)
        return await off_loop_unless_gone(request, tokenize_guarded, raw)

    @app.post("/detokenize")
    async def post_detokenize(request: Request):
        raw = await _read_body(request, limits.max_request_bytes, limits.read_timeout_s)
        return await off_loop_unless_gone(request, detokenize_guarded, raw)

    async def _respond(run: _Run, rid: str, model: str, score) -> dict:
        """The whole response once every choice is done; log-probabilities scored on their own thread."""
        parsed, chat = run.parsed, run.parsed.chat
        scores: dict[int, scoring.Scores] = {}
        if score is not None:
            aio = asyncio.get_running_loop()
            for i, o in enumerate(run.outs):
                ids = parsed.prompt_of(i) + o.ids
                scores[i] = await aio.run_in_executor(score_pool, score, ids)
        choices = []
        for i, o in enumerate(run.outs):
            prompt = parsed.prompt_of(i)
            body = (run.prompt_text(i) if parsed.echo else "") + o.text
            lp = plp = None
            if parsed.logprobs is not None:
                ids, k = prompt + o.ids, parsed.logprobs
                if chat:
                    lp = scoring.chat_logprobs(text, ids, scores[i], len(prompt), k)
                else:
                    start = 0 if parsed.echo else len(prompt)
                    lp = scoring.completion_logprobs(text, ids, scores[i], start, k, first_none=parsed.echo)
            if parsed.prompt_logprobs is not None:
                plp = scoring.prompt_logprobs(text, prompt, scores[i], parsed.prompt_logprobs)
            finish, reason = run.finish[i]
            content, message = _message(parsed, body) if chat else (body, None)
            if message and message.get("tool_calls") and (parsed.forced_tool in (None, "required")):
                finish = "tool_calls"  # vLLM: auto and required calls end so; a named function's answer ends "stop"
            choices.append(protocol.choice(i, chat, content, o.ids, finish, reason, logprobs=lp,
                                           prompt_logprobs=None if chat else plp, message=message))
        use = protocol.usage(sum(map(len, parsed.prompts)), sum(len(o.ids) for o in run.outs))
        doc = protocol.response(rid, model, chat, choices, use)
        if chat and parsed.prompt_logprobs is not None:  # vLLM's chat response carries them once, at the top
            doc["prompt_logprobs"] = scoring.prompt_logprobs(text, parsed.prompts[0], scores[0],
                                                             parsed.prompt_logprobs)
        return doc

    return app


def _message(parsed: protocol.Parsed, text: str) -> tuple[str | None, dict]:
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


class _ApiKey:
    """ASGI middleware: every /v1 request bears `Authorization: Bearer KEY` (compared in constant time), else 401."""

    def __init__(self, app, key: str):
        self.app, self.want = app, b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.want):
                body = protocol.error_body("Unauthorized: send the server's --api-key as `Authorization: Bearer "
                                           "KEY`", 401)
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)


ENGINE_PARAMS = {"stop token": "stop_token_ids", "allowed_token_ids": "allowed_token_ids",
                 "logit_bias": "logit_bias", "bad_words": "bad_words"}


def _param_of_engine_error(message: str, chat: bool) -> str:
    """The request field an engine `validate_request` error is about (the prompt unless it names another)."""
    return next((f for head, f in ENGINE_PARAMS.items() if message.startswith(head)), "messages" if chat else "prompt")


READ_TIMEOUT_S = 60.0  # the longest wait for the next piece of a request body (a half-open client)


async def _read_body(request: Request, limit: int, timeout: float = READ_TIMEOUT_S) -> bytes:
    """The body, refused as soon as it is known to be longer than `limit` bytes (Content-Length, then counted); a
    body that is not JSON (Content-Type) is refused before it is read (415), a client that stops sending for
    `timeout` seconds gets a 408, one that goes away mid-body is dropped quietly (`_Gone`)."""
    def too_long(n: str) -> APIError:
        return APIError(f"the request body is {n} bytes, more than --max-request-bytes {limit}")

    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(f"the request body must be JSON: send `Content-Type: application/json`, not {ctype[:60]!r}",
                       status=415)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_long(length)
    chunks, n = [], 0
    it = request.stream().__aiter__()
    while True:
        try:
            c = await asyncio.wait_for(it.__anext__(), timeout)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise APIError(f"the request body did not arrive: nothing for {timeout:.0f} s", status=408) from None
        except ClientDisconnect:
            raise _Gone() from None
        n += len(c)
        if n > limit:
            raise too_long(f"over {limit}")
        chunks.append(c)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is read, so `receive` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


class _Run:
    """The choices of one HTTP request (an engine request each, or none: echo with max_tokens 0): their outputs,
    metrics, and the event each becomes."""

    def __init__(self, loop: EngineLoop, sinks: list[Sink | None], events: asyncio.Queue, parsed: protocol.Parsed,
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


async def _collect(run: _Run, request: Request) -> None:
    """Every choice to its end; `_Gone` if the client goes away first (its engine requests aborted)."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while run.pending:
            get = asyncio.ensure_future(run.next())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:  # the client went away: nobody to answer; `finally` frees the pages
                get.cancel()
                raise _Gone()
            get.result()
    finally:
        gone.cancel()
        run.abort_rest()


async def _stream(run: _Run, rid: str, model: str) -> AsyncIterator[str]:
    chat, parsed = run.parsed.chat, run.parsed
    split = [parsers.ReasoningStream() for _ in run.sinks] if parsed.reasoning else None
    forced = [parsers.ForcedToolStream(parsed.forced_tool) for _ in run.sinks] if parsed.forced_tool else None
    tools = [parsers.ToolCallStream() for _ in run.sinks] if parsed.tools else None
    try:
        for i in range(len(run.sinks)):
            if chat:
                yield _sse(protocol.chunk(rid, model, True, i, "", [], None, role=True))
            elif parsed.echo or run.sinks[i] is None:  # the prompt first (echo); a choice with nothing to generate
                finish = "length" if run.sinks[i] is None else None
                yield _sse(protocol.chunk(rid, model, False, i, run.prompt_text(i) if parsed.echo else "", [],
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
            yield _sse(protocol.chunk(rid, model, chat, index, piece, ids, finish, stop_reason=reason,
                                      reasoning=thought, tool_calls=calls))
        if parsed.include_usage:
            use = protocol.usage(sum(map(len, parsed.prompts)), sum(len(o.ids) for o in run.outs))
            yield _sse(protocol.usage_chunk(rid, model, chat, use))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the stream was cancelled) or an error ended it: free what is left
        run.abort_rest()
