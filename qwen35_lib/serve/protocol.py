"""The OpenAI wire format: request bodies into (prompts, SamplingParams), results into response objects.

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
`suffix`, beam search, tools,
`logits_processors`, `documents`, `priority` and the rest of `REFUSED`; log-probabilities with `stream`. A field the
server does not know is refused (400) unless the server runs with `--ignore-unknown-fields`. Each choice carries
`token_ids` (its output ids), a vLLM-style extension. List fields are bounded (`Limits`: stop strings, bad words,
logit_bias entries), so no request's parsing, or its per-token work later, grows without a limit.

`parse` runs on a worker thread (tokenizing and template rendering are CPU work); every failure is an `APIError`.
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


@dataclasses.dataclass
class Parsed:
    """One HTTP request: its prompts (token ids), one choice per (prompt, sample) with its SamplingParams (None: nothing
    to generate, `echo` with max_tokens 0), and response options."""

    prompts: list[list[int]]
    params: list[SamplingParams | None]  # one per choice, choice i = prompt i // n, sample i % n
    stream: bool
    include_usage: bool
    chat: bool
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: str | None = None
    n: int = 1
    logprobs: int | None = None  # top log-probabilities per output token (0: the chosen token's only); None: none
    echo: bool = False  # the prompt is part of the choice's text (and of its logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (top-k per prompt token); None: none
    stop_ids: tuple[int, ...] = ()  # the request's own stop_token_ids (a finish on one names it in stop_reason)
    reasoning: bool = False  # split the reasoning from the content (chat, --reasoning-parser)
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops the reasoning
    tools: bool = False  # parse tool calls from the content (chat with `tools`, --tool-call-parser)
    forced_tool: str | None = None  # tool_choice "required", or the named function's name: the answer is the calls

    @property
    def scored(self) -> bool:
        """Whether the choices need the model's log-probabilities (a scoring forward after generation)."""
        return self.logprobs is not None or self.prompt_logprobs is not None

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]


# --- the fields ------------------------------------------------------------------------------------------------
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "stream_options", "n",
          "best_of", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "min_tokens",
          "skip_special_tokens", "add_special_tokens", "truncate_prompt_tokens", "request_id", "logprobs", "echo",
          "prompt_logprobs",
          # structured outputs (`serve.structured`): parsed and compiled beside `parse`
          "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_whitespace_pattern", "guided_decoding_backend"}
COMPLETION = COMMON | {"prompt"}
CHAT = COMMON | {"messages", "max_completion_tokens", "chat_template", "chat_template_kwargs",
                 "add_generation_prompt", "continue_final_message", "top_logprobs", "tools", "tool_choice",
                 "include_reasoning"}
# accepted whatever their value: they do not change what is generated (labels, or options of features absent here)
NO_EFFECT = {"user", "metadata", "store", "service_tier", "cache_salt", "return_token_ids", "parallel_tool_calls",
             "spaces_between_special_tokens"}
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


def check_fields(body: dict, chat: bool, limits: Limits) -> None:
    """A 400 naming the first field that is refused (not neutral) or unknown (unless ignored)."""
    known = CHAT if chat else COMPLETION
    for name, value in body.items():
        if name in known or name in NO_EFFECT:
            continue
        if name in REFUSED:
            neutral, why = REFUSED[name]
            if not any(value is None if v is None else (type(value) is type(v) and value == v) for v in neutral):
                raise APIError(f"`{name}` is not supported by this server: {why}", name)
            continue
        if not limits.ignore_unknown_fields:
            where = "/v1/chat/completions" if chat else "/v1/completions"
            raise APIError(f"unknown field `{name}` for {where}; remove it, or start the server with "
                           "--ignore-unknown-fields to ignore fields it does not know", name)


def get(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    """`body[name]` (`default` when absent or null), refused with a 400 naming it unless of `kinds`."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise APIError(f"`{name}` must be {' or '.join(k.__name__ for k in kinds)}, got a boolean", name)
    if not isinstance(v, kinds):
        raise APIError(f"`{name}` must be {' or '.join(k.__name__ for k in kinds)}, got {type(v).__name__}", name)
    return v


def is_int(x: Any) -> bool:
    """An int that is not a bool (in Python a bool is an int: not a count or an id)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(is_int(t) for t in x)


def _ids(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise APIError(f"`{name}` must be a list of integer token ids", name)
    return v


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


def _encode_all(text: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text. `encode_batch`, not `encode`: the tokenizer releases the GIL only there, so a long
    prompt tokenizing on a worker thread does not stall the event loop and the engine thread meanwhile."""
    try:
        return [list(e.ids) for e in text.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]
    except Exception as e:  # noqa: BLE001 - the tokenizer's errors are the input's
        raise APIError(f"the tokenizer could not encode the prompt: {type(e).__name__}: {e}", "prompt") from None


def encode(text: Any, s: str, add_special_tokens: bool) -> list[int]:
    """Token ids of one text (`_encode_all` of one)."""
    return _encode_all(text, [s], add_special_tokens)[0]


def completion_prompts(body: dict, text: Any, limits: Limits) -> list[list[int]]:
    """`prompt` as a list of token-id prompts: text (needs the tokenizer), texts, ids, or lists of ids.
    The count and the characters of the text prompts are checked before anything is tokenized."""
    p = body.get("prompt")
    if isinstance(p, str) or _is_ids(p):
        items: list = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or _is_ids(x) for x in p):
        items = p
    else:
        raise APIError("`prompt` must be a string, a list of strings, a list of token ids, or a list of lists of "
                       "token ids (non-empty)", "prompt")
    if len(items) > limits.max_prompts_per_request:
        raise APIError(f"{len(items)} prompts in one request, more than --max-prompts-per-request "
                       f"{limits.max_prompts_per_request}; split them over several requests", "prompt")
    texts = [x for x in items if isinstance(x, str)]
    if texts and text is None:
        raise APIError("this server has no tokenizer, so `prompt` must be token ids (e.g. [1, 2, 3]); or start it "
                       "with --tokenizer DIR (a directory with tokenizer.json)", "prompt")
    for x in texts:
        chars_ok(len(x), limits, "prompt")
    encoded = iter(_encode_all(text, texts, get(body, "add_special_tokens", (bool,), True)) if texts else [])
    return [next(encoded) if isinstance(x, str) else list(x) for x in items]


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, list):
        if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text", ""), str)
                   for c in content):
            raise APIError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                           "supported", "messages")
        return "".join(c.get("text", "") for c in content)
    if content is not None and not isinstance(content, str):
        raise APIError(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return content or ""


def chat_prompt(body: dict, text: Any, limits: Limits) -> list[int]:
    """`messages` through the chat template (the request's `chat_template` or the tokenizer's), then tokenized.

    1. messages checked: objects with a string `role`, content a string or text parts (joined); their
       characters counted against --max-prompt-chars before anything is rendered;
    2. rendered with `add_generation_prompt` (default true) and `chat_template_kwargs` as template variables;
    3. `continue_final_message`: rendered without the generation prompt, then cut after the last message's
       content, so the model continues that message (exclusive with add_generation_prompt, as in vLLM);
    4. encoded without special tokens (the template wrote them) unless `add_special_tokens`."""
    from qwen35_lib.text import render_chat

    template = get(body, "chat_template", (str,))
    if template is not None and not limits.trust_request_chat_template:
        raise APIError("a request's own `chat_template` is refused (a template is code the server runs); start the "
                       "server with --trust-request-chat-template to allow it", "chat_template")
    if text is None or (template is None and text.chat_template is None):
        raise APIError("this server has no chat template (it needs a tokenizer with tokenizer_config.json "
                       "`chat_template`, or the request's `chat_template`); use /v1/completions", "messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("`messages` must be a non-empty list of {\"role\", \"content\"}", "messages")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string `role`", "messages")
        flat.append({**m, "content": _message_text(i, m.get("content"))})
    chars_ok(sum(len(m["content"]) for m in flat), limits, "messages")
    kwargs = get(body, "chat_template_kwargs", (dict,), {})
    gen = get(body, "add_generation_prompt", (bool,), True)
    cont = get(body, "continue_final_message", (bool,), False)
    if gen and cont and "add_generation_prompt" in body:
        raise APIError("`add_generation_prompt` and `continue_final_message` cannot both be true",
                       "continue_final_message")
    gen = gen and not cont
    reserved = {"messages", "add_generation_prompt"} | set(text.special_tokens)
    clash = sorted(set(kwargs) & reserved)
    if clash:
        raise APIError(f"chat_template_kwargs cannot set `{clash[0]}` (the server sets it)", "chat_template_kwargs")
    tools = body.get("tools")
    if tools:  # the template writes the tool descriptions (Qwen's reads `tools`)
        kwargs = {**kwargs, "tools": tools}
    try:
        rendered = render_chat(template or text.chat_template, flat, gen, text.special_tokens, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template (the request's own, or fed its kwargs) failing is the input's
        raise APIError(f"the chat template failed: {type(e).__name__}: {e}",
                       "chat_template_kwargs" if kwargs else "messages") from None
    if cont:
        last = flat[-1]["content"].rstrip()
        cut = rendered.rfind(last) if last else -1
        if cut < 0:
            raise APIError("continue_final_message: the last message's content is not in the rendered template",
                           "continue_final_message")
        rendered = rendered[:cut + len(last)]
    chars_ok(len(rendered), limits, "messages")
    return encode(text, rendered, get(body, "add_special_tokens", (bool,), False))


def _number(body: dict, name: str, default: float) -> float:
    v = float(get(body, name, (int, float), default))
    if v != v or v in (float("inf"), float("-inf")):
        raise APIError(f"`{name}` must be a finite number", name)
    return v


def _stop_strings(body: dict, text: Any, limits: Limits) -> tuple[str, ...]:
    """The stop strings, at most --max-stop-strings of them and --max-prompt-chars characters in all (a token's stop
    search reads at most that many: `output.ChoiceOutput`); duplicates dropped."""
    stop = body.get("stop")
    if stop is None or stop == "" or stop == []:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise APIError("`stop` must be a non-empty string or a list of non-empty strings", "stop")
    bound_size("stop", items, limits)
    total = sum(map(len, items))
    if total > limits.max_prompt_chars:
        raise APIError(f"the `stop` strings hold {total} characters, more than --max-prompt-chars "
                       f"{limits.max_prompt_chars}; shorten them", "stop")
    if text is None:
        raise APIError("`stop` strings need a tokenizer (this server has none); use `stop_token_ids`", "stop")
    return tuple(dict.fromkeys(items))


def _logit_bias(body: dict, limits: Limits) -> dict[int, float] | None:
    v = get(body, "logit_bias", (dict,))
    if v is None:
        return None
    bound_size("logit_bias", v, limits)
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except ValueError:
            raise APIError(f"`logit_bias` keys must be token ids (as strings), got {k[:40]!r}", "logit_bias") from None
        if not isinstance(b, (int, float)) or isinstance(b, bool):
            raise APIError(f"`logit_bias` values must be numbers, got {str(b)[:40]!r} for {k[:40]!r}", "logit_bias")
        out[t] = float(b)
    return out


def _bad_words(body: dict, text: Any, limits: Limits) -> list[list[int]] | None:
    """Each bad word's token ids, as written and with a leading space (as vLLM tokenizes them): at most
    --max-bad-words words, each at most --max-prompt-chars long, tokenized in one batch, duplicates dropped in
    linear time (a dict of tuples)."""
    v = body.get("bad_words")
    if v is None or v == []:
        return None
    if not isinstance(v, list) or not all(isinstance(w, str) and w for w in v):
        raise APIError("`bad_words` must be a list of non-empty strings", "bad_words")
    bound_size("bad_words", v, limits)
    if text is None:
        raise APIError("`bad_words` need a tokenizer (this server has none)", "bad_words")
    for w in v:
        chars_ok(len(w), limits, "bad_words")
    variants = [x for w in dict.fromkeys(v) for x in (w, " " + w.lstrip())]
    unique = dict.fromkeys(tuple(ids) for ids in _encode_all(text, variants, False) if ids)
    return [list(ids) for ids in unique]


def _count(body: dict, name: str, limits: Limits, low: int = 0) -> int | None:
    """An optional count field (logprobs, top_logprobs, prompt_logprobs) in [low, --max-logprobs]."""
    v = get(body, name, (int,))
    if v is not None and not low <= v <= limits.max_logprobs:
        raise APIError(f"`{name}` must be in [{low}, {limits.max_logprobs}] (--max-logprobs), got {v}", name)
    return v


def _seed(body: dict) -> int | None:
    """vLLM takes any 64-bit seed; the sampler keys on 32 bits: a seed below 2**32 is itself, a larger (or negative)
    one folds its two halves together (deterministic: the same seed draws the same tokens)."""
    seed = get(body, "seed", (int,))
    if seed is None:
        return None
    if not -2**63 <= seed < 2**64:
        raise APIError(f"`seed` must be a 64-bit integer, got {seed}", "seed")
    seed %= 2**64
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def sample_seed(seed: int, j: int) -> int:
    """The seed of sample j of a request with `n` > 1 (sample 0 keeps the request's seed)."""
    return seed if j == 0 else (seed * 0x9E3779B1 + j * 0x85EBCA77) & 0xFFFFFFFF


# sampling-parameter fields as the request names them
PARAM_NAMES = {"max_new_tokens": "max_tokens", "bad_words_ids": "bad_words"}
# generation_config.json keys a server takes as request defaults (vLLM's --generation-config auto)
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")


def parse(body: Any, text: Any, chat: bool, limits: Limits) -> Parsed:
    """A request body into prompts and sampling parameters, or an APIError naming the field."""
    check_body(body, limits)
    check_fields(body, chat, limits)
    n = get(body, "n", (int,), 1)
    if n < 1:
        raise APIError(f"`n` must be >= 1, got {n}", "n")
    best_of = get(body, "best_of", (int,), n)
    if best_of < 1:
        raise APIError(f"`best_of` must be >= 1, got {best_of}", "best_of")
    if best_of != n:
        raise APIError("`best_of` other than `n` is not supported (vLLM's V1 engine refuses it too); send `n`",
                       "best_of")
    stream = get(body, "stream", (bool,), False)
    if chat:
        want = get(body, "logprobs", (bool,), False)
        top = _count(body, "top_logprobs", limits)
        if top is not None and not want:
            raise APIError("`top_logprobs` needs `logprobs`: true", "top_logprobs")
        logprobs = (top or 0) if want else None
        echo = get(body, "echo", (bool,), False)
        if echo:
            raise APIError("`echo` is not supported for chat by this server; use /v1/completions", "echo")
    else:
        logprobs = _count(body, "logprobs", limits)
        echo = get(body, "echo", (bool,), False)
    prompt_logprobs = _count(body, "prompt_logprobs", limits)
    tools, forced_tool = _tools(body, limits) if chat else (False, None)
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and stream:
            raise APIError(f"`{name}` with `stream`: true is not supported by this server; send stream: false",
                           name)
    stop = _stop_strings(body, text, limits)
    max_tokens = get(body, "max_tokens", (int,))
    if chat:
        max_tokens = get(body, "max_completion_tokens", (int,), max_tokens)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and (max_tokens < 0 or (max_tokens == 0 and not echo)):
        raise APIError(f"`{name}` must be >= 1 (0 only with `echo`), got {max_tokens}", name)
    if max_tokens is not None and max_tokens >= limits.max_model_len:
        raise APIError(f"`{name}` = {max_tokens} leaves no room for a prompt within --max-model-len "
                       f"{limits.max_model_len}; lower it", name)
    truncate = get(body, "truncate_prompt_tokens", (int,))
    if truncate is not None and truncate < 1 and truncate != -1:
        raise APIError(f"`truncate_prompt_tokens` must be >= 1 (or -1: --max-model-len), got {truncate}",
                       "truncate_prompt_tokens")
    defaults = dict(limits.defaults)
    common = dict(
        temperature=_number(body, "temperature", defaults.get("temperature", 1.0)),
        top_p=_number(body, "top_p", defaults.get("top_p", 1.0)),
        min_p=_number(body, "min_p", defaults.get("min_p", 0.0)),
        presence_penalty=_number(body, "presence_penalty", defaults.get("presence_penalty", 0.0)),
        frequency_penalty=_number(body, "frequency_penalty", defaults.get("frequency_penalty", 0.0)),
        repetition_penalty=_number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0)),
        top_k=get(body, "top_k", (int,), int(defaults.get("top_k", 0))), min_tokens=get(body, "min_tokens", (int,), 0),
        logit_bias=_logit_bias(body, limits), allowed_token_ids=_ids(body, "allowed_token_ids"),
        bad_words_ids=_bad_words(body, text, limits))
    common["top_k"] = 0 if common["top_k"] == -1 else common["top_k"]
    # vLLM's stop semantics: stop_token_ids add to the model's EOS ids; ignore_eos drops the EOS ids only
    stop_ids = tuple(dict.fromkeys(_ids(body, "stop_token_ids") or ()))
    ignore_eos = get(body, "ignore_eos", (bool,), False)
    eos = () if ignore_eos else tuple(t for t in limits.eos_token_ids if t not in stop_ids)
    common["stop_token_ids"] = stop_ids + eos if stop_ids or ignore_eos else None  # None: the model's EOS ids
    seed = _seed(body)
    if seed is None:
        seed = random.randrange(2**32) if common["temperature"] > 0 else 0
    opts = get(body, "stream_options", (dict,), {})
    include_usage = get(opts, "include_usage", (bool,), False)
    for key, value in opts.items():
        if key != "include_usage" and value not in (None, False):
            raise APIError(f"`stream_options.{key}` is not supported (only include_usage)", "stream_options")
    rid = get(body, "request_id", (str,))
    include_stop = get(body, "include_stop_str_in_output", (bool,), False)
    skip = get(body, "skip_special_tokens", (bool,), True)
    prompts = [chat_prompt(body, text, limits)] if chat else completion_prompts(body, text, limits)
    if len(prompts) * n > limits.max_prompts_per_request:
        raise APIError(f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices in one request, more than "
                       f"--max-prompts-per-request {limits.max_prompts_per_request}; lower n or split the request",
                       "n")
    if truncate is not None:
        keep = limits.max_model_len if truncate == -1 else truncate
        prompts = [p[-keep:] for p in prompts]
    params: list[SamplingParams | None] = []
    for p in prompts:
        k = max_tokens if max_tokens is not None else (limits.max_model_len - len(p) if chat else 16)
        if len(p) + max(k, 1) > limits.max_model_len:
            raise APIError(f"prompt of {len(p)} tokens + {name}={k} = {len(p) + k} exceeds --max-model-len "
                           f"{limits.max_model_len}: shorten the prompt (or set truncate_prompt_tokens) or lower "
                           f"{name}", "messages" if chat else "prompt")
        for j in range(n):
            if k == 0:  # echo only: the prompt, scored if asked; nothing generated
                params.append(None)
                continue
            try:
                params.append(SamplingParams(max_new_tokens=k, seed=sample_seed(seed, j), **common))
            except (ValueError, TypeError) as e:
                raise APIError(str(e), _param_of(str(e))) from None
    reasoning = chat and limits.reasoning_parser is not None
    include_reasoning = get(body, "include_reasoning", (bool,), True) if chat else True
    return Parsed(prompts, params, stream, include_usage, chat, stop, include_stop, skip, rid, n, logprobs, echo,
                  prompt_logprobs, stop_ids, reasoning, include_reasoning, tools, forced_tool)


def _tools(body: dict, limits: Limits) -> tuple[bool, str | None]:
    """(whether a chat request's tool calls are parsed from its answer, the forced tool choice): `tools` (function
    definitions) with `tool_choice` auto (the default with tools) on a server with a tool-call parser; "required" or
    a named function ({"type": "function", "function": {"name"}}), as vLLM, by structured outputs (the answer is
    the calls' JSON: `serve.structured.tool_schema`), no parser needed; none: the tools only reach the template."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise APIError("`tool_choice` needs `tools`", "tool_choice")
        return False, None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                              and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise APIError("`tools` must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}",
                       "tools")
    if choice == "none":
        return False, None
    forced = None
    if choice == "required":
        forced = "required"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError("a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           "tool_choice")
        if name not in [t["function"]["name"] for t in tools]:
            raise APIError(f"`tool_choice` names the function {name[:60]!r}, which is not in `tools`", "tool_choice")
        forced = name
    elif choice not in (None, "auto"):
        raise APIError("`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", "tool_choice")
    elif limits.tool_call_parser is None:
        raise APIError("`tools` with tool_choice \"auto\" need the server started with --enable-auto-tool-choice "
                       "--tool-call-parser hermes (as vLLM)", "tools")
    return forced is None, forced


def _param_of(message: str) -> str | None:
    """The request field a SamplingParams error names first ("invalid sampling parameters: min_p must ...")."""
    head = message.split(": ", 1)[-1].split(" ", 1)[0]
    return PARAM_NAMES.get(head, head) if head.isidentifier() else None


# --- responses ------------------------------------------------------------------------------------------------
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
