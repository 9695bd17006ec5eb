"""The OpenAI response objects: a whole response, its choices, the streamed chunks, usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

FINISH = {"eos": "stop", "length": "length", "stop": "stop"}


def new_id(chat: bool, request_id: str | None = None) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


def choice(index: int, chat: bool, text: str | None, token_ids: list[int], finish: str | None,
           stop_reason: str | int | None = None, logprobs: dict | None = None,
           prompt_logprobs: list | None = None, message: dict | None = None) -> dict:
    base: dict[str, Any] = dict(index=index, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason,
                                token_ids=token_ids)
    if prompt_logprobs is not None:
        base["prompt_logprobs"] = prompt_logprobs
    if chat:  # `message`: more of the message (reasoning, tool_calls)
        return base | dict(message=dict(role="assistant", content=text) | (message or {}))
    return base | dict(text=text)


def response(rid: str, model: str, chat: bool, choices: list[dict], use: dict) -> dict:
    return dict(id=rid, object="chat.completion" if chat else "text_completion", created=int(time.time()),
                model=model, choices=choices, usage=use)


def chunk(rid: str, model: str, chat: bool, index: int, piece: str | None, token_ids: list[int],
          finish: str | None, role: bool = False, stop_reason: str | int | None = None,
          reasoning: str | None = None, tool_calls: list | None = None) -> dict:
    """One streamed event. Chat: `delta` ({"role"} first, then {"content"}, {"tool_calls"}); completions: `text`."""
    c: dict[str, Any] = dict(index=index, logprobs=None, finish_reason=finish, token_ids=token_ids)
    if finish is not None:
        c["stop_reason"] = stop_reason
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if reasoning:  # vLLM's older and newer names
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if piece is not None:
            delta["content"] = piece
        if tool_calls:
            delta["tool_calls"] = tool_calls
        c["delta"] = delta
    else:
        c["text"] = piece or ""
    return dict(id=rid, object="chat.completion.chunk" if chat else "text_completion", created=int(time.time()),
                model=model, choices=[c])


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    return dict(id=rid, object="chat.completion.chunk" if chat else "text_completion", created=int(time.time()),
                model=model, choices=[], usage=use)
