"""The OpenAI wire format: what a request body may hold, as typed pydantic models (`CompletionRequest`,
`ChatRequest`: strict types, unknown fields forbidden, as vLLM's protocol), the server's bounds on a request
(`Limits`), and how a refusal is answered (`APIError`: one line naming the field and the fix).

Every field a request may carry is either honoured or refused; none is accepted and ignored.

Honoured (as vLLM honours them): `prompt` as text, a list of texts, token ids, or a list of token-id lists
(`/v1/completions`); `messages` through the chat template (`/v1/chat/completions`) with `chat_template`,
`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`; `max_tokens` (chat also
`max_completion_tokens`; 0 with `echo`: the prompt scored, nothing generated), `temperature` (default 1, as OpenAI,
or the checkpoint's generation_config.json), `top_p`, `top_k` (-1 or 0 = off), `min_p`, `seed` (64-bit, as vLLM),
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`, `allowed_token_ids`, `bad_words`,
`min_tokens`, `stop` (strings, cut from the text; `include_stop_str_in_output`), `stop_token_ids` (added to the
model's EOS ids, as vLLM), `ignore_eos` (ignores the EOS ids only), `skip_special_tokens`, `add_special_tokens`,
`truncate_prompt_tokens`, `stream`, `stream_options.include_usage`, `request_id` (the response id), `n` (choices per
prompt), `logprobs` / `top_logprobs` (the raw model's log-probabilities of each output token and of the most likely
ones, vLLM's default `raw_logprobs`), `echo` and `prompt_logprobs` (the prompt's tokens scored; completions),
structured outputs (`response_format`, `structured_outputs`, `guided_*`: parsed by `serve.structured`), and
fields with no effect on the output (`user`, `metadata`, ...: `NO_EFFECT`).
Refused with a 400 naming the field, unless sent with their neutral value (null, false, the default): `best_of` > 1,
`suffix`, beam search, tools on /v1/completions,
`logits_processors`, `documents`, `priority` and the rest of `REFUSED`; log-probabilities with `stream`. A field the
server does not know is refused (400) unless the server runs with `--ignore-unknown-fields`. Each choice carries
`token_ids` (its output ids), a vLLM-style extension. List fields are bounded (`Limits`: stop strings, bad words,
logit_bias entries), so no request's parsing, or its per-token work later, grows without a limit.

`serve.request.parse` turns a validated request into prompts and sampling parameters; `serve.responses` builds
the answers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from qwen35_lib.serve import refusals


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error",
             500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": APIError.TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """The server's bounds on one request (each a `serve` option; a refusal names the option)."""

    max_model_len: int  # --max-model-len: prompt + max_tokens
    max_prompts_per_request: int = 1024  # --max-prompts-per-request
    max_prompt_chars: int = 1 << 20  # --max-prompt-chars: checked before tokenizing
    max_request_bytes: int = 16 << 20  # --max-request-bytes: the body, checked while it is read
    read_timeout_s: float = 60.0  # the longest wait for the next piece of a body (a half-open client gets a 408)
    max_json_depth: int = 64  # nesting of the body's JSON
    ignore_unknown_fields: bool = False  # --ignore-unknown-fields
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request's own `chat_template`
    max_stop_strings: int = 256  # --max-stop-strings: `stop` entries (each is scanned at every token)
    max_bad_words: int = 256  # --max-bad-words: `bad_words` entries (each is matched at every step)
    max_logit_bias: int = 1024  # --max-logit-bias: `logit_bias` entries
    max_logprobs: int = 20  # --max-logprobs: `logprobs`, `top_logprobs`, `prompt_logprobs` (vLLM's default 20)
    max_grammar_bytes: int = 64 << 10  # --max-grammar-bytes: a structured-output constraint (schema, ...) as JSON
    eos_token_ids: tuple[int, ...] = ()  # the model's EOS ids (`stop_token_ids` add to them)
    defaults: tuple[tuple[str, float], ...] = ()  # sampling defaults (generation_config.json): (field, value)
    reasoning_parser: str | None = None  # --reasoning-parser: "qwen3" splits <think>...</think> from the content
    tool_call_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice: "hermes"


# --- the field types ------------------------------------------------------------------------------------------
def _rule(ok: Any, must: str) -> AfterValidator:
    """A constraint refused as "`field` {must}, got {value}"."""
    def check(v: Any) -> Any:
        if not ok(v):
            raise PydanticCustomError("rule", "{must}, got {got}", {"must": must, "got": refusals.short(v)})
        return v
    return AfterValidator(check)


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias keys are token ids written as strings (JSON object keys)."""
    out = {}
    for k, b in bias.items():
        try:
            out[int(k)] = b
        except ValueError:
            raise PydanticCustomError("rule", "keys must be token ids (as strings), got {got}",
                                      {"got": refusals.short(k)}) from None
    return out


Finite = Annotated[float, AllowInfNan(False)]  # strict: an int or a float, never a bool
Count = Annotated[int, Field(ge=0)]  # logprobs, top_logprobs, prompt_logprobs (at most --max-logprobs: `parse`)
NonEmpty = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[int], Field(min_length=1)]

# refused unless neutral: field -> (neutral values, what to do instead)
REFUSED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "tools": ((None, []), "tool calling is a chat feature; use /v1/chat/completions"),
    "tool_choice": ((None, "none"), "tool calling is a chat feature; use /v1/chat/completions"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "documents": ((None, []), "documents (RAG templates) are not supported"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "priority": ((None, 0), "priority scheduling is not enabled (requests run first come, first served)"),
    "return_tokens_as_token_ids": ((None, False), "logprobs name tokens by their text (or token_id:N without a "
                                                  "tokenizer)"),
    "reasoning_effort": ((None,), "reasoning effort is not supported; use chat_template_kwargs"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "audio output is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "mm_processor_kwargs": ((None, {}), "multimodal input is not supported"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported"),
    "kv_transfer_params": ((None,), "KV transfer is not supported"),
    "vllm_xargs": ((None, {}), "extra vLLM arguments are not supported"),
}


def _is_neutral(field: str, value: Any) -> bool:
    """Whether a `REFUSED` field's value is one of its neutral values (of the same JSON type: 0 is not false)."""
    return any(value is None if v is None else (type(value) is type(v) and value == v) for v in REFUSED[field][0])


def _neutral(value: Any, info: ValidationInfo) -> Any:
    """A `REFUSED` field passes only with a neutral value."""
    if _is_neutral(info.field_name, value):
        return value
    raise PydanticCustomError("refused", "is not supported by this server: {why}", {"why": REFUSED[info.field_name][1]})


Refused = Annotated[Any, AfterValidator(_neutral)]


class _Strict(BaseModel):
    """A request object: JSON types as they are (no "5" for 5, no true for 1), unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    """An object inside a request whose other keys pass through (a message's `name`, a tool's `parameters`)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Open):
    include_usage: bool | None = None

    @model_validator(mode="after")
    def _only_include_usage(self) -> StreamOptions:
        for key, value in (self.model_extra or {}).items():
            if value not in (None, False):
                raise PydanticCustomError("rule", "holds `{key}`, which is not supported (only include_usage)",
                                          {"key": key[:40]})
        return self


class TextPart(_Open):
    type: Literal["text"]
    text: str = ""


class Message(_Open):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The content as one text (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class Function(_Open):
    name: str


class Tool(_Open):
    type: Literal["function"] = "function"
    function: Function


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: Function


class _NoEffect(BaseModel):
    """Accepted whatever their value: they do not change what is generated (labels, or options of features absent
    here)."""

    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    cache_salt: Any = None
    return_token_ids: Any = None
    parallel_tool_calls: Any = None
    spaces_between_special_tokens: Any = None


class _Refused(BaseModel):
    """The fields of `REFUSED`: a 400 naming the field and why, unless sent with a neutral value."""

    suffix: Refused = None
    use_beam_search: Refused = None
    length_penalty: Refused = None
    tools: Refused = None
    tool_choice: Refused = None
    functions: Refused = None
    function_call: Refused = None
    documents: Refused = None
    logits_processors: Refused = None
    priority: Refused = None
    return_tokens_as_token_ids: Refused = None
    reasoning_effort: Refused = None
    modalities: Refused = None
    audio: Refused = None
    prediction: Refused = None
    web_search_options: Refused = None
    mm_processor_kwargs: Refused = None
    prompt_embeds: Refused = None
    kv_transfer_params: Refused = None
    vllm_xargs: Refused = None


class _Common(_Strict, _Refused, _NoEffect):
    """The fields of both generation routes (null: the default, as if absent)."""

    model: Any = None  # checked against the served model before the body is parsed (a 404)
    n: Annotated[int, Field(ge=1)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    prompt_logprobs: Count | None = None
    stop: str | list[NonEmpty] | None = None
    max_tokens: int | None = None
    truncate_prompt_tokens: Annotated[int, _rule(lambda v: v >= 1 or v == -1,
                                                 "must be >= 1 (or -1: --max-model-len)")] | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    min_p: Finite | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    logit_bias: Annotated[dict[str, float], AfterValidator(_token_keys)] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[NonEmpty] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: Annotated[int, _rule(lambda s: -2**63 <= s < 2**64, "must be a 64-bit integer")] | None = None
    request_id: str | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    add_special_tokens: bool | None = None
    # structured outputs: checked and compiled by `serve.structured` (their own messages, each naming its field)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None


class CompletionRequest(_Common):
    """A /v1/completions body."""

    prompt: str | Ids | Annotated[list[str | Ids], Field(min_length=1)]
    logprobs: Count | None = None  # top log-probabilities per output token


class ChatTemplate(BaseModel):
    """What the chat template renders: the messages and its options (a chat request's, or /tokenize's)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # /tokenize: the other fields are not its to check

    messages: Annotated[list[Message], Field(min_length=1)]
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None


class ChatRequest(ChatTemplate, _Common):
    """A /v1/chat/completions body."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None  # whether to return them; `top_logprobs` how many alternatives
    top_logprobs: Count | None = None
    include_reasoning: bool | None = None


class TokenizeRequest(BaseModel):
    """A /tokenize body without `messages` (with them: `ChatTemplate`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: str
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    tokens: list[Annotated[int, Field(ge=0)]]


@functools.cache
def _refused(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` refused unless neutral (those checked by `_neutral`)."""
    return frozenset(name for name, f in model.model_fields.items()
                     if any(getattr(m, "func", None) is _neutral for m in f.metadata))


def _honoured(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(model.model_fields) - NO_EFFECT - _refused(model)


NO_EFFECT = frozenset(_NoEffect.model_fields)
COMPLETION = _honoured(CompletionRequest)
CHAT = _honoured(ChatRequest)
COMMON = COMPLETION & CHAT


# --- a body into a request, or an APIError naming the field -----------------------------------------------------
def validate(model: type[BaseModel], body: dict, where: str, ignore_unknown: bool = False,
             must: dict[str, str] | None = None) -> Any:
    """`body` as a `model`, or an APIError naming the field at fault (`must`: what a field of this route must be,
    where its type says less)."""
    if ignore_unknown:
        body = {k: v for k, v in body.items() if k in model.model_fields}
    err = None if ignore_unknown else _unknown_first(model, body)
    if err is None:
        try:
            return model.model_validate(body)
        except ValidationError as e:
            err = refusals.first(e.errors(include_url=False), body)
    field = str(err["loc"][0]) if err["loc"] else None
    message, param = (f"`{field}` {must[field]}", field) if must and field in must else refusals.message(err, where)
    raise APIError(message, param) from None


def _unknown_first(model: type[BaseModel], body: dict) -> dict | None:
    """The error `refusals.first` would pick from pydantic's when `body` holds a field `model` forbids, found
    without validating (pydantic builds the whole model first: `validate` of a 5-field completion body with an
    unknown field took 13-19 us that way, 2-4 us this way): the first unknown field in body order, unless a refused
    field with a value that is not neutral comes before it (then None: pydantic words that one)."""
    forbid, fields, refused = _keys(model)
    if not forbid:
        return None
    for key, value in body.items():
        if key not in fields:
            return {"type": "extra_forbidden", "loc": (key,), "msg": "Extra inputs are not permitted", "input": value}
        if key in refused and not _is_neutral(key, value):
            return None
    return None


@functools.cache
def _keys(model: type[BaseModel]) -> tuple[bool, frozenset[str], frozenset[str]]:
    """(whether `model` forbids unknown fields, its fields, those refused unless neutral)."""
    return model.model_config.get("extra") == "forbid", frozenset(model.model_fields), _refused(model)


def read_request(body: dict, chat: bool, limits: Limits) -> CompletionRequest | ChatRequest:
    """A generation body as its route's request model; unknown fields refused unless --ignore-unknown-fields."""
    if chat:
        return validate(ChatRequest, body, "/v1/chat/completions", limits.ignore_unknown_fields)
    return validate(CompletionRequest, body, "/v1/completions", limits.ignore_unknown_fields)


# the list fields with a bound on their length: (the `Limits` field, what an entry is, the option)
_BOUNDS = {"stop": ("max_stop_strings", "strings", "--max-stop-strings"),
           "bad_words": ("max_bad_words", "words", "--max-bad-words"),
           "logit_bias": ("max_logit_bias", "entries", "--max-logit-bias")}


def bound_size(field: str, v: list | dict, limits: Limits) -> None:
    """A 400 naming `field` and its option when `v` holds more entries than the option allows."""
    attr, what, option = _BOUNDS[field]
    if len(v) > getattr(limits, attr):
        raise APIError(f"`{field}` holds {len(v)} {what}, more than {option} {getattr(limits, attr)}; send fewer",
                       field)


def check_sizes(body: Any, limits: Limits) -> None:
    """The bounded list fields (`_BOUNDS`) by length alone, before `check_body` visits every value: walking 1M stop
    strings held the GIL for 0.4 s, and other requests waited for it."""
    if isinstance(body, dict):
        for field in _BOUNDS:
            if isinstance(body.get(field), (list, dict)):
                bound_size(field, body[field], limits)


def check_body(body: Any, limits: Limits) -> None:
    """A JSON object nested at most `max_json_depth` deep whose strings are all valid Unicode (no lone surrogate,
    which `\\ud800` in JSON can write and no tokenizer can encode). Iterative: no recursion limit to hit."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    todo: list[tuple[Any, int]] = [(body, 1)]
    while todo:
        x, depth = todo.pop()
        if depth > limits.max_json_depth:
            raise APIError(f"the request body is nested deeper than {limits.max_json_depth} levels")
        if isinstance(x, str):
            _check_text(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                _check_text(k)
                todo.append((v, depth + 1))
        elif isinstance(x, list):
            todo.extend((v, depth + 1) for v in x)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"the request holds a string that is not valid Unicode (a lone surrogate at character "
                       f"{e.start}: {s[e.start]!r})") from None


def chars_ok(n: int, limits: Limits, param: str) -> None:
    """Refuse (a 400 naming `param`) a text of `n` characters over --max-prompt-chars."""
    if n > limits.max_prompt_chars:
        raise APIError(f"`{param}` holds {n} characters, more than --max-prompt-chars {limits.max_prompt_chars} (no "
                       f"prompt that long fits --max-model-len {limits.max_model_len}); shorten it", param)


# generation_config.json keys a server takes as request defaults (vLLM's --generation-config auto)
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")
