"""The OpenAI wire format: request bodies into (prompts, SamplingParams), results into response objects.

Accepted, as vLLM accepts them: `prompt` as text, a list of texts, token ids, or a list of token-id lists
(`/v1/completions`); `messages` through the chat template (`/v1/chat/completions`); `max_tokens` (chat also
`max_completion_tokens`), `temperature` (default 1, as OpenAI), `top_p`, `top_k` (vLLM: -1 or 0 = off), `seed`,
`stream`, `stream_options.include_usage`, and vLLM's `ignore_eos` and `stop_token_ids`. Refused with a 400
naming the field: `n` > 1, `logprobs`, `echo`, `stop` strings, and every malformed value. Each choice carries
`token_ids` (its output ids), a vLLM-style extension.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from typing import Any

from qwen35_lib.engine import SamplingParams


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": APIError.TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


@dataclasses.dataclass
class Parsed:
    """One HTTP request: its prompts (token ids, one engine request each), sampling, and response options."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    chat: bool


def _get(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise APIError(f"`{name}` must be {' or '.join(k.__name__ for k in kinds)}, got a boolean", name)
    if not isinstance(v, kinds):
        raise APIError(f"`{name}` must be {' or '.join(k.__name__ for k in kinds)}, got {type(v).__name__}", name)
    return v


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(body: dict, text: Any) -> list[list[int]]:
    """`prompt` as a list of token-id prompts: text (needs the tokenizer), texts, ids, or lists of ids."""
    p = body.get("prompt")
    if isinstance(p, str):
        items: list = [p]
    elif _is_ids(p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or _is_ids(x) for x in p):
        items = p
    else:
        raise APIError("`prompt` must be a string, a list of strings, a list of token ids, or a list of lists of "
                       "token ids (non-empty)", "prompt")
    out = []
    for x in items:
        if isinstance(x, str):
            if text is None:
                raise APIError("this server has no tokenizer, so `prompt` must be token ids (e.g. [1, 2, 3]); or "
                               "start it with --tokenizer DIR (a directory with tokenizer.json)", "prompt")
            out.append(text.encode(x))
        else:
            out.append(list(x))
    return out


def chat_prompt(body: dict, text: Any) -> list[int]:
    """`messages` through the chat template (add_generation_prompt=True); text parts of list contents joined."""
    if text is None or text.chat_template is None:
        raise APIError("this server has no chat template (it needs a tokenizer with tokenizer_config.json "
                       "`chat_template`); use /v1/completions", "messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("`messages` must be a non-empty list of {\"role\", \"content\"}", "messages")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string `role`", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise APIError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(c.get("text", "")) for c in content)
        elif content is not None and not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or a list of text parts", "messages")
        flat.append({**m, "content": content or ""})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError("`chat_template_kwargs` must be an object", "chat_template_kwargs")
    try:
        return text.encode_chat(flat, add_generation_prompt=True, **kwargs)
    except ValueError as e:
        raise APIError(str(e), "messages") from None


def parse(body: Any, text: Any, chat: bool, max_model_len: int) -> Parsed:
    """A request body into prompts and sampling parameters, or an APIError naming the field."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name in ("n", "best_of"):
        if _get(body, name, (int,), 1) != 1:
            raise APIError(f"`{name}` > 1 is not supported; send one request per sample", name)
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise APIError("`logprobs` is not supported by this server", "logprobs")
    if body.get("echo"):
        raise APIError("`echo` is not supported by this server", "echo")
    if body.get("stop") not in (None, [], ""):
        raise APIError("`stop` strings are not supported; use `stop_token_ids` (token ids)", "stop")
    prompts = [chat_prompt(body, text)] if chat else completion_prompts(body, text)

    max_tokens = _get(body, "max_tokens", (int,))
    if chat:
        max_tokens = _get(body, "max_completion_tokens", (int,), max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"`max_tokens` must be >= 1, got {max_tokens}", "max_tokens")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    top_k = _get(body, "top_k", (int,), 0)
    top_k = 0 if top_k == -1 else top_k
    seed = _get(body, "seed", (int,))
    if seed is None:
        seed = random.randrange(2**32) if temperature > 0 else 0
    stop_ids = _get(body, "stop_token_ids", (list,))
    if stop_ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError("`stop_token_ids` must be a list of integer token ids", "stop_token_ids")
    ignore_eos = bool(_get(body, "ignore_eos", (bool,), False))
    stream = bool(_get(body, "stream", (bool,), False))
    opts = _get(body, "stream_options", (dict,), {})
    params = []
    for p in prompts:
        n = max_tokens if max_tokens is not None else (max_model_len - len(p) if chat else 16)
        try:
            params.append(SamplingParams(max_new_tokens=max(n, 1), temperature=temperature, top_k=top_k, top_p=top_p,
                                         seed=seed, ignore_eos=ignore_eos,
                                         stop_token_ids=tuple(stop_ids) if stop_ids is not None else None))
        except ValueError as e:
            raise APIError(str(e)) from None
    return Parsed(prompts, params, stream, bool(opts.get("include_usage")), chat)


# --- responses ------------------------------------------------------------------------------------------------
FINISH = {"eos": "stop", "length": "length"}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


def choice(index: int, chat: bool, text: str, token_ids: list[int], finish: str | None) -> dict:
    base: dict[str, Any] = dict(index=index, logprobs=None, finish_reason=finish, token_ids=token_ids)
    if chat:
        return base | dict(message=dict(role="assistant", content=text))
    return base | dict(text=text)


def response(rid: str, model: str, chat: bool, choices: list[dict], use: dict) -> dict:
    return dict(id=rid, object="chat.completion" if chat else "text_completion", created=int(time.time()),
                model=model, choices=choices, usage=use)


def chunk(rid: str, model: str, chat: bool, index: int, piece: str | None, token_ids: list[int],
          finish: str | None, role: bool = False) -> dict:
    """One streamed event. Chat: `delta` ({"role"} first, then {"content"}); completions: `text`."""
    c: dict[str, Any] = dict(index=index, logprobs=None, finish_reason=finish, token_ids=token_ids)
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if piece is not None:
            delta["content"] = piece
        c["delta"] = delta
    else:
        c["text"] = piece or ""
    return dict(id=rid, object="chat.completion.chunk" if chat else "text_completion", created=int(time.time()),
                model=model, choices=[c])


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    return dict(id=rid, object="chat.completion.chunk" if chat else "text_completion", created=int(time.time()),
                model=model, choices=[], usage=use)
