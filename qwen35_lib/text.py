"""Text in, text out: a checkpoint's tokenizer, its chat template, and an incremental detokenizer for streaming.

    text = load_text(checkpoint_dir)                      # tokenizer.json + tokenizer_config.json (chat template)
    ids = text.encode_chat([{"role": "user", "content": "hi"}])   # template rendered, add_generation_prompt=True
    stream = text.detokenizer()
    for token in tokens: print(stream.push(token), end="")       # never a broken multi-byte character
    print(stream.flush())

The chat template is rendered as HF transformers renders it (`apply_chat_template`): a sandboxed jinja2
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps
non-ASCII text, `raise_exception` and `strftime_now` globals, and the special tokens of tokenizer_config.json
(`bos_token`, `eos_token`, ...) as variables. The rendered text is encoded without adding special tokens (the
template wrote them).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("text prompts need the `tokenizers` package (a dependency of qwen35-playbook): "
                         "pip install tokenizers; or pass token ids") from None
    return tokenizers


def chat_template_of(root: pathlib.Path) -> str | None:
    """The checkpoint's chat template: `chat_template.jinja` (newer HF layout), else tokenizer_config.json's
    `chat_template` (a string, or a list of {"name", "template"} whose "default" entry is used)."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tc = _tokenizer_config(root)
    tpl = tc.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else None


def _tokenizer_config(root: pathlib.Path) -> dict:
    path = root / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def render_chat(template: str, messages: Sequence[dict], add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **kwargs: Any) -> str:
    """`messages` through a jinja2 chat template, as HF's `apply_chat_template(tokenize=False)` renders it."""
    import jinja2

    try:
        return _compiled(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                          **(special_tokens or {}), **kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from None


@functools.lru_cache(maxsize=8)  # a server renders every chat request with its checkpoint's one template
def _compiled(template: str) -> Any:
    """A chat template compiled in HF's sandbox (trim_blocks, lstrip_blocks, loop controls, `tojson`,
    `raise_exception`, `strftime_now`); compiling it took about 1.3 ms a request."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


@dataclasses.dataclass
class Text:
    """A `tokenizers.Tokenizer` with the checkpoint's chat template and special tokens."""

    tokenizer: Any
    chat_template: str | None = None
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json `chat_template` or "
                             "chat_template.jinja); send a plain prompt instead of chat messages")
        _check_messages(messages)
        return render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens, **kwargs)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens)


def _check_messages(messages: Sequence[dict]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\": ..., \"content\": ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string \"role\" and a \"content\"")


def load_text(root: str | pathlib.Path) -> Text:
    """The tokenizer of a checkpoint directory (tokenizer.json) with its chat template and special tokens."""
    root = pathlib.Path(root)
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{root} has no tokenizer.json; pass a checkpoint (or tokenizer) directory with one, "
                                "or send token ids")
    tokenizers = _import_tokenizers()
    tc = _tokenizer_config(root)
    special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(tc.get(k))) is not None}
    return Text(tokenizers.Tokenizer.from_file(str(path)), chat_template_of(root), special)


class IncrementalDetokenizer:
    """Text of a token stream, piece by piece, never splitting a multi-byte character.

    1. keep every id; `prefix` and `read` mark a window: ids[prefix:read] is text already emitted, decoded again
       for context (a decoder's output for a token can depend on its neighbours);
    2. on a new id, decode ids[prefix:] and ids[prefix:read]; if the first is longer and does not end in U+FFFD
       (the decoder's mark for an incomplete UTF-8 sequence), emit the difference and move the window on;
       otherwise emit nothing and wait for the next id;
    3. `flush()` at the end emits whatever is left (a sequence that never completes stays U+FFFD).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        """The new text that `token` completes ("" while a character is still partial)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            piece = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """The text held back at the end of the stream."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        piece = after[len(before):] if after.startswith(before) else ""
        self.prefix = self.read = len(self.ids)
        self.text += piece
        return piece
