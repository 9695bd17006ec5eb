"""The HTTP routes (FastAPI): `/v1/completions`, `/v1/chat/completions`, `/v1/models[/{id}]`, `/health`, `/ping`,
`/version`, `/metrics` (Prometheus), `/tokenize`, `/detokenize`.

A generation request:
1. the body is read on the event loop, refused (400 naming --max-request-bytes) as soon as it is longer than the
   server allows; then parsed and checked on a worker thread (JSON, `request.parse` with its bounds and the
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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from qwen35_lib.engine import SamplingParams
from qwen35_lib.engine.requests import validate_request
from qwen35_lib.serve import protocol, responses, scoring, structured
from qwen35_lib.serve.choices import Gone, Run, choice, collect, disconnected, stream
from qwen35_lib.serve.loop import EngineLoop, Sink
from qwen35_lib.serve.protocol import APIError, Limits
from qwen35_lib.serve.request import Parsed, chat_prompt, encode, from_request
from qwen35_lib.versions import library_version

log = logging.getLogger("qwen35_lib.serve")


def make_app(loop: EngineLoop, model_name: str, text: Any = None, limits: Limits | None = None,
             api_key: str | None = None) -> FastAPI:
    """The FastAPI app over a started `EngineLoop`; `text` (a `qwen35_lib.text.Text`) enables text prompts,
    text outputs and chat; `limits` bounds a request (default: `Limits` at the engine's max_model_len);
    `api_key`: the key every /v1 request must bear."""
    server = _Server(loop, model_name, text, limits)
    app = FastAPI(title="qwen35_lib serve", description="OpenAI-compatible server over the qwen35_lib engine")
    if api_key:
        app.add_middleware(_ApiKey, key=api_key)
    for error, handler in ((APIError, _api_error), (HTTPException, _http_error),
                           (RequestValidationError, _validation_error), (Gone, _gone), (Exception, _server_error)):
        app.add_exception_handler(error, handler)
    for path, route, methods in (
            ("/health", server.health, ["GET"]), ("/ping", server.health, ["GET", "POST"]),
            ("/version", server.version, ["GET"]), ("/metrics", server.metrics_text, ["GET"]),
            ("/v1/models", server.models, ["GET"]), ("/v1/models/{model_id:path}", server.model, ["GET"]),
            ("/v1/completions", server.completions, ["POST"]),
            ("/v1/chat/completions", server.chat_completions, ["POST"]),
            ("/tokenize", server.tokenize, ["POST"]), ("/detokenize", server.detokenize, ["POST"])):
        app.add_api_route(path, route, methods=methods)
    return app


# --- errors: every one in the OpenAI shape ------------------------------------------------------------------------
async def _api_error(_, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(_, e: HTTPException):
    return JSONResponse(protocol.error_body(str(e.detail), e.status_code), status_code=e.status_code)


async def _validation_error(_, e: RequestValidationError):
    return JSONResponse(protocol.error_body(str(e), 400), status_code=400)


async def _gone(_, e: Gone):
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _server_error(_, e: Exception):  # a bug of ours: still the OpenAI shape
    return JSONResponse(protocol.error_body(f"internal error: {type(e).__name__}: {e}", 500), status_code=500)


class _Server:
    """What the routes share: the engine loop, the tokenizer, the bounds, the worker pools (parsing: 4 threads;
    scoring: 1), the compiled grammars, the metrics. Each route is one method."""

    def __init__(self, loop: EngineLoop, model_name: str, text: Any, limits: Limits | None):
        self.loop, self.engine, self.model_name, self.text = loop, loop.engine, model_name, text
        limits = limits or Limits(max_model_len=self.engine.ec.max_model_len)
        if not limits.eos_token_ids:  # stop_token_ids add to these
            limits = dataclasses.replace(limits, eos_token_ids=tuple(self.engine.config.eos_token_ids))
        self.limits, self.created = limits, int(time.time())
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="qwen35-parse")
        self.score_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen35-score")
        self.grammars = structured.Grammars(text, self.engine.config.vocab_size, limits.eos_token_ids)
        self.scorer: scoring.Scorer | None = None  # made on first use: only logprobs requests pay its compiles
        try:
            from qwen35_lib.serve.metrics import Metrics

            self.metrics: Any = Metrics(loop, model_name)
        except ImportError:
            self.metrics = None

    # --- the engine's state, the model, the version -----------------------------------------------------------
    async def health(self):
        loop = self.loop
        if not loop.alive:
            return JSONResponse(protocol.error_body(loop.error or "the engine loop is not running", 503),
                                status_code=503)
        if not loop.ready:
            return JSONResponse({"status": "starting", "warmed_buckets": loop.warmed,
                                 "warmup_buckets": len(loop.warmup)}, status_code=503)
        return {"status": "ok", **loop.stats()}

    async def version(self):
        return {"version": library_version()}

    async def metrics_text(self):
        if self.metrics is None:
            raise APIError("metrics need prometheus_client: pip install 'qwen35-playbook[serve]'", status=503)
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def card(self) -> dict:
        return dict(id=self.model_name, object="model", created=self.created, owned_by="qwen35_lib",
                    root=self.model_name, parent=None, max_model_len=self.engine.ec.max_model_len)

    async def models(self):
        return {"object": "list", "data": [self.card()]}

    async def model(self, model_id: str):
        if model_id != self.model_name:
            raise APIError(f"the model `{model_id}` does not exist; this server serves `{self.model_name}`", "model",
                           status=404)
        return self.card()

    # --- a body, parsed off the event loop --------------------------------------------------------------------
    async def off_loop_unless_gone(self, request: Request, fn, *args):
        """`fn(*args)` on the parse pool; if the client goes away first, `Gone` at once (a job not yet started is
        cancelled; one running is bounded by the request limits and its result dropped)."""
        job = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not job.done():
            job.cancel()
            raise Gone()
        return job.result()

    async def handle(self, request: Request, fn):
        """The body read (bounded), then `fn(body)` on a worker thread: every failure there is the input's (4xx)."""
        raw = await _read_body(request, self.limits.max_request_bytes, self.limits.read_timeout_s)
        return await self.off_loop_unless_gone(request, self.guarded, fn, raw)

    def guarded(self, fn, raw: bytes):
        """`fn(read_json(raw))` (on the worker thread): an error not foreseen is the body's, answered 400."""
        try:
            return fn(self.read_json(raw))
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - not a known refusal, but caused by this body
            log.exception("request refused after an unexpected error while parsing it")
            raise APIError(f"the request could not be processed: {type(e).__name__}: {str(e)[:200]}") from None

    def read_json(self, raw: bytes) -> Any:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise APIError(f"the request body is not valid JSON: {str(e)[:200]}") from None
        protocol.check_sizes(body, self.limits)  # before the walk over every value
        protocol.check_body(body, self.limits)
        m = body.get("model")
        if m is not None and m != self.model_name:
            raise APIError(f"the model `{str(m)[:100]}` does not exist; this server serves `{self.model_name}` "
                           "(GET /v1/models)", "model", status=404)
        return body

    # --- generation -----------------------------------------------------------------------------------------------
    async def completions(self, request: Request):
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self.generate(request, chat=True)

    def parse_chat(self, body: dict) -> Parsed:
        return self.parse_generation(body, True)

    def parse_completion(self, body: dict) -> Parsed:
        return self.parse_generation(body, False)

    def parse_generation(self, body: dict, chat: bool) -> Parsed:
        """The body parsed, its structured-output grammar compiled (a bad schema is a 400 naming its field), and each
        choice checked by the engine's own `validate_request` (a choice with nothing to generate: its prompt)."""
        # read_json ran protocol.check_sizes and check_body: not again (5 us of the 35-55 us a fuzz body took here)
        parsed = from_request(protocol.read_request(body, chat, self.limits), self.text, self.limits)
        spec = structured.parse_spec(body, self.limits)
        if spec is not None:
            grammar = self.grammars.compile(spec)
            marker = structured.reasoning_marker(self.text, parsed.prompts[0]) if parsed.reasoning else None
            if marker is not None:  # the reasoning is free, the answer after </think> follows the grammar
                grammar = grammar.after(marker)
            parsed.params = [None if sp is None else dataclasses.replace(sp, structured=grammar)
                             for sp in parsed.params]
        for i, sp in enumerate(parsed.params):
            try:
                validate_request(self.engine.config, self.engine.ec, parsed.prompt_of(i), sp or SamplingParams(1))
            except ValueError as e:
                raise APIError(str(e), _param_of_engine_error(str(e), chat)) from None
        return parsed

    async def generate(self, request: Request, chat: bool):
        t0 = time.perf_counter()
        parsed = await self.handle(request, self.parse_chat if chat else self.parse_completion)
        if parsed.scored and self.engine.mesh is not None:
            name = "logprobs" if parsed.logprobs is not None else "prompt_logprobs"
            raise APIError(f"`{name}` is computed under --layout single only; drop it or serve with --layout single",
                           name)
        run = self.submit(parsed, t0)
        rid = responses.new_id(chat, parsed.request_id)
        if parsed.stream:
            return StreamingResponse(stream(run, rid, self.model_name), media_type="text/event-stream")
        await collect(run, request)
        return await self.respond(run, rid)

    def submit(self, parsed: Parsed, t0: float) -> Run:
        """One engine request per choice, a prompt's n choices forked from one prefill; their events on one queue."""
        loop = self.loop
        if not loop.alive:
            raise APIError(loop.error or "the engine loop is not running", status=503)
        events: asyncio.Queue = asyncio.Queue()
        sinks = [None if sp is None else Sink(asyncio.get_running_loop(), events, i)
                 for i, sp in enumerate(parsed.params)]
        for j, prompt in enumerate(parsed.prompts):
            group = [i for i in range(j * parsed.n, (j + 1) * parsed.n) if sinks[i] is not None]
            if group:
                loop.submit_forks(prompt, [parsed.params[i] for i in group], [sinks[i] for i in group])
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(map(len, parsed.prompts)))
        return Run(loop, sinks, events, parsed, self.text, self.metrics, t0)

    def score(self, ids: list[int]) -> scoring.Scores:
        if self.scorer is None:
            self.scorer = scoring.Scorer(self.engine, self.limits.max_logprobs)
        return self.scorer.score(ids)

    async def respond(self, run: Run, rid: str) -> dict:
        """The whole response once every choice is done; log-probabilities scored on their own thread."""
        parsed, chat, text = run.parsed, run.parsed.chat, self.text
        scores: dict[int, scoring.Scores] = {}
        if parsed.scored:
            aio = asyncio.get_running_loop()
            for i, o in enumerate(run.outs):
                scores[i] = await aio.run_in_executor(self.score_pool, self.score, parsed.prompt_of(i) + o.ids)
        choices = [choice(run, i, text, scores.get(i)) for i in range(len(run.outs))]
        use = responses.usage(sum(map(len, parsed.prompts)), sum(len(o.ids) for o in run.outs))
        doc = responses.response(rid, self.model_name, chat, choices, use)
        if chat and parsed.prompt_logprobs is not None:  # vLLM's chat response carries them once, at the top
            doc["prompt_logprobs"] = scoring.prompt_logprobs(text, parsed.prompts[0], scores[0],
                                                             parsed.prompt_logprobs)
        return doc

    # --- /tokenize, /detokenize -----------------------------------------------------------------------------------
    async def tokenize(self, request: Request):
        return await self.handle(request, self.tokenize_body)

    async def detokenize(self, request: Request):
        return await self.handle(request, self.detokenize_body)

    def need_text(self) -> Any:
        if self.text is None:
            raise APIError("this server has no tokenizer (start it with --tokenizer DIR)")
        return self.text

    def tokenize_body(self, body: dict) -> dict:
        text = self.need_text()
        if body.get("messages") is not None:
            ids = chat_prompt(protocol.validate(protocol.ChatTemplate, body, "/tokenize"), text, self.limits)
        else:
            req = protocol.validate(protocol.TokenizeRequest, body, "/tokenize",
                                    must={"prompt": "must be a string (or send `messages`)"})
            protocol.chars_ok(len(req.prompt), self.limits, "prompt")
            ids = encode(text, req.prompt, req.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": self.engine.ec.max_model_len, "tokens": ids, "token_strs": None}

    def detokenize_body(self, body: dict) -> dict:
        text = self.need_text()
        must = f"must be a list of token ids in [0, {text.vocab_size})"
        req = protocol.validate(protocol.DetokenizeRequest, body, "/detokenize", must={"tokens": must})
        if any(t >= text.vocab_size for t in req.tokens):
            raise APIError(f"`tokens` {must}", "tokens")
        return {"prompt": text.decode(req.tokens)}


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
    `timeout` seconds gets a 408, one that goes away mid-body is dropped quietly (`Gone`)."""
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
            raise Gone() from None
        n += len(c)
        if n > limit:
            raise too_long(f"over {limit}")
        chunks.append(c)
    return b"".join(chunks)


