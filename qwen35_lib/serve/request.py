"""A validated request (`protocol.CompletionRequest` / `ChatRequest`) into what the engine runs: its prompts as
token ids (texts tokenized, messages through the chat template) and one `SamplingParams` per choice.

The checks here are the ones a field's type cannot make: against the server's bounds (`Limits`: --max-model-len,
--max-logprobs, the list bounds), between fields (`best_of` and `n`, `top_logprobs` and `logprobs`, log-probabilities
and `stream`, `tools` and `tool_choice`), and those that need the tokenizer. `parse` runs on a worker thread
(tokenizing and template rendering are CPU work); every failure is an `APIError` naming the field.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from qwen35_lib.engine import SamplingParams
from qwen35_lib.serve.protocol import (
    APIError,
    ChatRequest,
    ChatTemplate,
    CompletionRequest,
    Limits,
    NamedToolChoice,
    bound_size,
    chars_ok,
    check_body,
    check_sizes,
    read_request,
)


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


def parse(body: Any, text: Any, chat: bool, limits: Limits) -> Parsed:
    """A request body into prompts and sampling parameters, or an APIError naming the field."""
    check_sizes(body, limits)  # the bounded lists by length, before any walk over their values
    check_body(body, limits)
    return from_request(read_request(body, chat, limits), text, limits)


def from_request(req: CompletionRequest | ChatRequest, text: Any, limits: Limits) -> Parsed:
    """A validated request into prompts and sampling parameters (`parse` after its checks of the raw body)."""
    chat = isinstance(req, ChatRequest)
    n = req.n or 1
    if (req.best_of or n) != n:
        raise APIError("`best_of` other than `n` is not supported (vLLM's V1 engine refuses it too); send `n`",
                       "best_of")
    logprobs, echo = _logprobs(req, limits)
    prompt_logprobs = _count(req.prompt_logprobs, "prompt_logprobs", limits)
    tools, forced_tool = _tools(req, limits) if isinstance(req, ChatRequest) else (False, None)
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and req.stream:
            raise APIError(f"`{name}` with `stream`: true is not supported by this server; send stream: false",
                           name)
    stop = _stop_strings(req.stop, text, limits)
    max_tokens, name = _max_tokens(req, echo, limits)
    common = _sampling(req, text, limits)
    # vLLM's stop semantics: stop_token_ids add to the model's EOS ids; ignore_eos drops the EOS ids only
    stop_ids = tuple(dict.fromkeys(req.stop_token_ids or ()))
    eos = () if req.ignore_eos else tuple(t for t in limits.eos_token_ids if t not in stop_ids)
    common["stop_token_ids"] = stop_ids + eos if stop_ids or req.ignore_eos else None  # None: the model's EOS ids
    seed = fold_seed(req.seed) if req.seed is not None else None
    if seed is None:
        seed = random.randrange(2**32) if common["temperature"] > 0 else 0
    prompts = [chat_prompt(req, text, limits)] if isinstance(req, ChatRequest) else \
        completion_prompts(req, text, limits)
    if len(prompts) * n > limits.max_prompts_per_request:
        raise APIError(f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices in one request, more than "
                       f"--max-prompts-per-request {limits.max_prompts_per_request}; lower n or split the request",
                       "n")
    if req.truncate_prompt_tokens is not None:
        keep = limits.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
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
    chat_req = req if isinstance(req, ChatRequest) else None
    return Parsed(prompts, params, bool(req.stream), bool(req.stream_options and req.stream_options.include_usage),
                  chat, stop, bool(req.include_stop_str_in_output), req.skip_special_tokens is not False,
                  req.request_id, n, logprobs, echo, prompt_logprobs, stop_ids,
                  reasoning=chat and limits.reasoning_parser is not None,
                  include_reasoning=chat_req is None or chat_req.include_reasoning is not False,
                  tools=tools, forced_tool=forced_tool)


def _count(v: int | None, name: str, limits: Limits) -> int | None:
    """An optional count field (logprobs, top_logprobs, prompt_logprobs; >= 0 by its type) up to --max-logprobs."""
    if v is not None and v > limits.max_logprobs:
        raise APIError(f"`{name}` must be in [0, {limits.max_logprobs}] (--max-logprobs), got {v}", name)
    return v


def _logprobs(req: CompletionRequest | ChatRequest, limits: Limits) -> tuple[int | None, bool]:
    """(top log-probabilities per output token, or None; echo). Chat: `logprobs` true with `top_logprobs`
    alternatives; completions: `logprobs` is the count."""
    if isinstance(req, CompletionRequest):
        return _count(req.logprobs, "logprobs", limits), bool(req.echo)
    top = _count(req.top_logprobs, "top_logprobs", limits)
    if top is not None and not req.logprobs:
        raise APIError("`top_logprobs` needs `logprobs`: true", "top_logprobs")
    if req.echo:
        raise APIError("`echo` is not supported for chat by this server; use /v1/completions", "echo")
    return ((top or 0) if req.logprobs else None), False


def _max_tokens(req: CompletionRequest | ChatRequest, echo: bool, limits: Limits) -> tuple[int | None, str]:
    """(max_tokens or chat's max_completion_tokens, None: up to --max-model-len; the field's name)."""
    max_tokens, name = req.max_tokens, "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and (max_tokens < 0 or (max_tokens == 0 and not echo)):
        raise APIError(f"`{name}` must be >= 1 (0 only with `echo`), got {max_tokens}", name)
    if max_tokens is not None and max_tokens >= limits.max_model_len:
        raise APIError(f"`{name}` = {max_tokens} leaves no room for a prompt within --max-model-len "
                       f"{limits.max_model_len}; lower it", name)
    return max_tokens, name


def _sampling(req: CompletionRequest | ChatRequest, text: Any, limits: Limits) -> dict:
    """The SamplingParams fields a request sets (absent: the generation_config.json default, else OpenAI's)."""
    defaults = dict(limits.defaults)

    def number(name: str, default: float) -> float:
        v = getattr(req, name)
        return float(defaults.get(name, default) if v is None else v)

    top_k = req.top_k if req.top_k is not None else int(defaults.get("top_k", 0))
    if req.logit_bias is not None:
        bound_size("logit_bias", req.logit_bias, limits)
    return dict(temperature=number("temperature", 1.0), top_p=number("top_p", 1.0), min_p=number("min_p", 0.0),
                presence_penalty=number("presence_penalty", 0.0),
                frequency_penalty=number("frequency_penalty", 0.0),
                repetition_penalty=number("repetition_penalty", 1.0), top_k=0 if top_k == -1 else top_k,
                min_tokens=req.min_tokens or 0, logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
                bad_words_ids=_bad_words(req.bad_words, text, limits))


def fold_seed(seed: int) -> int:
    """vLLM takes any 64-bit seed (the field's type bounds it); the sampler keys on 32 bits: a seed below 2**32 is
    itself, a larger (or negative) one folds its two halves together (the same seed draws the same tokens)."""
    seed %= 2**64
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def sample_seed(seed: int, j: int) -> int:
    """The seed of sample j of a request with `n` > 1 (sample 0 keeps the request's seed)."""
    return seed if j == 0 else (seed * 0x9E3779B1 + j * 0x85EBCA77) & 0xFFFFFFFF


def _tools(req: ChatRequest, limits: Limits) -> tuple[bool, str | None]:
    """(whether a chat request's tool calls are parsed from its answer, the forced tool choice): `tools` (function
    definitions) with `tool_choice` auto (the default with tools) on a server with a tool-call parser; "required" or
    a named function ({"type": "function", "function": {"name"}}), as vLLM, by structured outputs (the answer is
    the calls' JSON: `serve.structured.tool_schema`), no parser needed; none: the tools only reach the template."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError("`tool_choice` needs `tools`", "tool_choice")
        return False, None
    if choice in ("none", "required"):
        return False, None if choice == "none" else "required"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in req.tools}:
            raise APIError(f"`tool_choice` names the function {choice.function.name[:60]!r}, which is not in "
                           "`tools`", "tool_choice")
        return False, choice.function.name
    if limits.tool_call_parser is None:
        raise APIError("`tools` with tool_choice \"auto\" need the server started with --enable-auto-tool-choice "
                       "--tool-call-parser hermes (as vLLM)", "tools")
    return True, None


# sampling-parameter fields as the request names them
PARAM_NAMES = {"max_new_tokens": "max_tokens", "bad_words_ids": "bad_words"}


def _param_of(message: str) -> str | None:
    """The request field a SamplingParams error names first ("invalid sampling parameters: min_p must ...")."""
    head = message.split(": ", 1)[-1].split(" ", 1)[0]
    return PARAM_NAMES.get(head, head) if head.isidentifier() else None


# --- text: stop strings, bad words, prompts -----------------------------------------------------------------------
def _stop_strings(stop: str | list[str] | None, text: Any, limits: Limits) -> tuple[str, ...]:
    """The stop strings, at most --max-stop-strings of them and --max-prompt-chars characters in all (a token's stop
    search reads at most that many: `output.ChoiceOutput`); duplicates dropped."""
    if not stop:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    bound_size("stop", items, limits)
    total = sum(map(len, items))
    if total > limits.max_prompt_chars:
        raise APIError(f"the `stop` strings hold {total} characters, more than --max-prompt-chars "
                       f"{limits.max_prompt_chars}; shorten them", "stop")
    if text is None:
        raise APIError("`stop` strings need a tokenizer (this server has none); use `stop_token_ids`", "stop")
    return tuple(dict.fromkeys(items))


def _bad_words(words: list[str] | None, text: Any, limits: Limits) -> list[list[int]] | None:
    """Each bad word's token ids, as written and with a leading space (as vLLM tokenizes them): at most
    --max-bad-words words, each at most --max-prompt-chars long, tokenized in one batch, duplicates dropped in
    linear time (a dict of tuples)."""
    if not words:
        return None
    bound_size("bad_words", words, limits)
    if text is None:
        raise APIError("`bad_words` need a tokenizer (this server has none)", "bad_words")
    for w in words:
        chars_ok(len(w), limits, "bad_words")
    variants = [x for w in dict.fromkeys(words) for x in (w, " " + w.lstrip())]
    unique = dict.fromkeys(tuple(ids) for ids in _encode_all(text, variants, False) if ids)
    return [list(ids) for ids in unique]


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


def completion_prompts(req: CompletionRequest, text: Any, limits: Limits) -> list[list[int]]:
    """`prompt` as a list of token-id prompts: text (needs the tokenizer), texts, ids, or lists of ids.
    The count and the characters of the text prompts are checked before anything is tokenized."""
    p = req.prompt
    items: list = [p] if isinstance(p, str) or all(isinstance(t, int) for t in p) else p
    if len(items) > limits.max_prompts_per_request:
        raise APIError(f"{len(items)} prompts in one request, more than --max-prompts-per-request "
                       f"{limits.max_prompts_per_request}; split them over several requests", "prompt")
    texts = [x for x in items if isinstance(x, str)]
    if texts and text is None:
        raise APIError("this server has no tokenizer, so `prompt` must be token ids (e.g. [1, 2, 3]); or start it "
                       "with --tokenizer DIR (a directory with tokenizer.json)", "prompt")
    for x in texts:
        chars_ok(len(x), limits, "prompt")
    encoded = iter(_encode_all(text, texts, req.add_special_tokens is not False) if texts else [])
    return [next(encoded) if isinstance(x, str) else list(x) for x in items]


def chat_prompt(req: ChatTemplate, text: Any, limits: Limits) -> list[int]:
    """`messages` through the chat template (the request's `chat_template` or the tokenizer's), then tokenized.

    1. messages' characters (content a string or text parts, joined) counted against --max-prompt-chars before
       anything is rendered;
    2. rendered with `add_generation_prompt` (default true) and `chat_template_kwargs` as template variables;
    3. `continue_final_message`: rendered without the generation prompt, then cut after the last message's
       content, so the model continues that message (exclusive with add_generation_prompt, as in vLLM);
    4. encoded without special tokens (the template wrote them) unless `add_special_tokens`."""
    from qwen35_lib.text import render_chat

    template = req.chat_template
    if template is not None and not limits.trust_request_chat_template:
        raise APIError("a request's own `chat_template` is refused (a template is code the server runs); start the "
                       "server with --trust-request-chat-template to allow it", "chat_template")
    if text is None or (template is None and text.chat_template is None):
        raise APIError("this server has no chat template (it needs a tokenizer with tokenizer_config.json "
                       "`chat_template`, or the request's `chat_template`); use /v1/completions", "messages")
    flat = [{**m.model_dump(), "content": m.text()} for m in req.messages]
    chars_ok(sum(len(m["content"]) for m in flat), limits, "messages")
    kwargs = req.chat_template_kwargs or {}
    cont = bool(req.continue_final_message)
    if cont and req.add_generation_prompt is not False and "add_generation_prompt" in req.model_fields_set:
        raise APIError("`add_generation_prompt` and `continue_final_message` cannot both be true",
                       "continue_final_message")
    gen = req.add_generation_prompt is not False and not cont
    reserved = {"messages", "add_generation_prompt"} | set(text.special_tokens)
    clash = sorted(set(kwargs) & reserved)
    if clash:
        raise APIError(f"chat_template_kwargs cannot set `{clash[0]}` (the server sets it)", "chat_template_kwargs")
    if req.tools:  # the template writes the tool descriptions (Qwen's reads `tools`), as the request sent them
        kwargs = {**kwargs, "tools": [t.model_dump(exclude_unset=True) for t in req.tools]}
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
    return encode(text, rendered, bool(req.add_special_tokens))
