"""Pydantic's validation errors as the server's refusals: the one error to answer (`first`) in one line that names
the field, says what it must be, and what was sent (`message`), e.g. "`n` must be an integer, got a string"."""

from __future__ import annotations

from typing import Any

# what a field that is wrong must be, where a type alone does not say it (unions, lists of ids)
HELP = {
    "prompt": "must be a string, a list of strings, a list of token ids, or a list of lists of token ids (non-empty)",
    "stop": "must be a non-empty string or a list of non-empty strings",
    "bad_words": "must be a list of non-empty strings",
    "allowed_token_ids": "must be a list of integer token ids",
    "stop_token_ids": "must be a list of integer token ids",
    "logit_bias": "must be an object of token ids (as strings) to numbers, e.g. {\"50256\": -100}",
    "messages": "must be a non-empty list of {\"role\", \"content\"}",
    "messages.content": "must be a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
    "tools": "must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}",
    "tool_choice": "must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}",
}
# what a value of a JSON type is called, and what each pydantic type error asked for
_KINDS = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
          dict: "an object"}
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "list_type": "a list", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def short(v: Any) -> str:
    return repr(v) if isinstance(v, (int, float, type(None))) else repr(v)[:40]


def _name(field: str, limit: int = 60) -> str:
    """A field name the client sent, quoted for a one-line message: as written when printable and short, else its
    repr (newlines escaped), cut to `limit` characters."""
    if field.isprintable() and len(field) <= limit:
        return f"`{field}`"
    r = repr(field)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _path(loc: tuple) -> tuple[str, str, bool]:
    """(`messages[0].content` as written, `messages.content` as HELP keys it, whether a union tag was cut off)."""
    shown, key = "", []
    for part in loc:
        if isinstance(part, int):
            shown += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in _TYPE_TAGS:
            shown += ("." if shown else "") + part
            key.append(part)
        else:  # a union member's tag ('list[int]', "literal['auto', ...]", 'NamedToolChoice'), or a dict key
            return shown, ".".join(key), True
    return shown, ".".join(key), False


def message(err: dict, where: str) -> tuple[str, str | None]:
    """One pydantic error as (a one-line message that says what is wrong and what to send, the field it names)."""
    kind, ctx, loc = err["type"], err.get("ctx") or {}, err["loc"]
    if not loc:
        return f"the request body {err['msg'].lower()}", None
    field = str(loc[0])
    shown, key, cut = _path(loc)
    if kind == "extra_forbidden" and len(loc) == 1:
        return (f"unknown field {_name(field)} for {where}; remove it, or start the server with "
                "--ignore-unknown-fields to ignore fields it does not know"), field
    if kind in ("rule", "refused"):
        return f"`{shown}` {err['msg']}", field
    if field in HELP and field != "messages":  # its help covers whatever inside it is wrong
        return f"`{field}` {HELP[field]}", field
    if key in HELP and (cut or not isinstance(loc[-1], int)):  # `messages` itself, a message's `content`
        return f"`{shown}` {HELP[key]}", field
    got = _KINDS.get(type(err["input"]), type(err["input"]).__name__)
    if kind in _EXPECTED:
        return f"`{shown}` must be {_EXPECTED[kind]}, got {got}", field
    if kind == "missing":
        return f"`{shown}` is required", field
    if kind == "finite_number":
        return f"`{shown}` must be a finite number", field
    if kind == "greater_than_equal":
        return f"`{shown}` must be >= {ctx['ge']}, got {short(err['input'])}", field
    if kind == "literal_error":
        return f"`{shown}` must be {ctx['expected']}, got {short(err['input'])}", field
    if kind == "too_short":
        return f"`{shown}` must not be empty", field
    return f"`{shown}`: {err['msg']}", field


def first(errors: list[dict], body: dict) -> dict:
    """The error to answer: a refused or unknown field first (as before any value is read), then in body order."""
    order = {k: i for i, k in enumerate(body)}
    return min(errors, key=lambda e: (e["type"] not in ("refused", "extra_forbidden"),
                                      order.get(e["loc"][0] if e["loc"] else None, len(order))))
