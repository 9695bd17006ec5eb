"""Structured outputs: a grammar (a JSON schema, a regex, a choice of strings, a Lark or GBNF grammar) that masks
the next token of one request, compiled and matched by llguidance (the `serve` extra; vLLM's `guidance` backend).

    vocab = GrammarVocabulary(tokenizer_json, vocab_size=config.vocab_size, eos_ids=config.eos_token_ids)
    grammar = compile_grammar(vocab, "json", {"type": "object"})      # a ValueError naming what is wrong
    engine.generate([prompt], SamplingParams(max_new_tokens=64, structured=grammar))

How it reaches the step: a request whose `SamplingParams.structured` is a `Grammar` takes the step's
logits-processing path (`sampling.fill_processing_row`); its `Request` holds a `Matcher` of its own (`Grammar.matcher`,
a copy of the compiled matcher), and before each step that samples for it the engine asks the matcher which tokens
may come next (`Matcher.allowed(output)`): the matcher first consumes the outputs it has not seen, then computes its
bitmask; the others get -inf in the row's bias. Other rows of the batch are untouched. A matcher is a function of the
output so far, so a preemption (the outputs kept and recomputed) leaves it valid.

1. the tokenizer's vocabulary is read once (`GrammarVocabulary`: llguidance's LLTokenizer over tokenizer.json, the
   model's vocabulary size and EOS ids; ~1 s for a 150k vocabulary);
2. `compile_grammar` turns a spec into llguidance's grammar text and builds one matcher from it (the compile: a
   bad schema or regex is a ValueError here, before the request reaches the engine); llguidance bounds its own work
   per grammar and per step (`LLParserLimits`), and the caller bounds the spec's size;
3. once the grammar is complete (the matcher is stopped) only the EOS ids are allowed, and the request stops as any
   request stops on EOS (with `ignore_eos` it goes on sampling EOS up to max_tokens, as vLLM's does);
4. `grammar.after(marker)` starts the grammar after the first `marker` (token ids) in the outputs, the tokens before
   it free (a reasoning model's `</think>`: vLLM constrains only the answer after the reasoning).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need llguidance: pip install 'qwen35-playbook[serve]' (or pip install "
                         "llguidance)") from None
    return llguidance


class GrammarVocabulary:
    """llguidance's view of a tokenizer (`tokenizer_json`: tokenizer.json's text, `tokenizers.Tokenizer.to_str()`),
    over the model's `vocab_size` (ids the tokenizer lacks are never allowed) with the model's EOS ids."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        eos = [int(t) for t in eos_ids]
        if not eos:
            raise ValueError("structured outputs need the model's EOS ids (a grammar ends on one)")
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(eos)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
        self.words = (self.vocab_size + 31) // 32  # int32 words of a bitmask


def grammar_text(kind: str, spec: Any, *, whitespace_flexible: bool = True, whitespace_pattern: str | None = None
                 ) -> str:
    """llguidance's grammar for a spec, as vLLM's guidance backend builds it: "json" (a JSON schema, dict or text),
    "json_object" (any JSON object), "regex", "choice" (a list of strings, one of them exactly), "grammar" (Lark or
    GBNF). JSON whitespace is flexible unless `whitespace_flexible` is false (vLLM's disable_any_whitespace)."""
    llg = _llguidance()
    if kind in ("json", "json_object"):
        options: dict[str, Any] = {"whitespace_flexible": whitespace_flexible}
        if whitespace_pattern is not None:
            options["whitespace_pattern"] = whitespace_pattern
        schema = {"type": "object"} if kind == "json_object" else spec
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        if not (isinstance(spec, list) and spec and all(isinstance(s, str) for s in spec)):
            raise ValueError("a choice is a non-empty list of strings")
        return llg.grammar_from("choice", spec)
    if kind == "grammar":
        try:
            return llg.grammar_from("grammar", spec)
        except ValueError as e:
            raise ValueError(str(e)) from None
    raise ValueError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")


class Grammar:
    """A compiled grammar over a vocabulary; `matcher()` gives each request a matcher of its own. Compared by
    identity (it is a field of the frozen `SamplingParams`)."""

    def __init__(self, vocab: GrammarVocabulary, text: str, kind: str = "grammar"):
        llg = _llguidance()
        self.vocab, self.kind = vocab, kind
        self._matcher = llg.LLMatcher(vocab.tokenizer, text, log_level=0)  # the compile (the GIL released)
        if self._matcher.is_error():
            raise ValueError(self._matcher.get_error())

    def matcher(self) -> Matcher:
        return Matcher(self._matcher.deep_copy(), self.vocab)

    def after(self, marker: Sequence[int]) -> GrammarAfter:
        """This grammar applied only to the outputs after the first `marker` (token ids) in them: vLLM's
        structured outputs under a reasoning parser, which leave the reasoning free and constrain the answer after
        `</think>`."""
        return GrammarAfter(self, tuple(int(t) for t in marker))

    def __repr__(self) -> str:
        return f"Grammar({self.kind})"


class GrammarAfter:
    """A `Grammar` that starts after a marker in the outputs (`Grammar.after`)."""

    def __init__(self, grammar: Grammar, marker: tuple[int, ...]):
        if not marker:
            raise ValueError("a grammar's start marker needs at least one token id")
        self.grammar, self.marker, self.vocab = grammar, marker, grammar.vocab

    def matcher(self) -> Matcher:
        return Matcher(self.grammar._matcher.deep_copy(), self.vocab, start_after=self.marker)

    def __repr__(self) -> str:
        return f"Grammar({self.grammar.kind}, after {list(self.marker)})"


class Matcher:
    """One request's grammar state: `allowed(output)` is the bool [vocab_size] mask of the tokens that may follow
    `output` (the request's outputs so far; those not yet consumed are consumed first). Never all false: once the
    grammar is complete, or a token it refused was forced on it, the EOS ids. With `start_after` (token ids), the
    grammar starts after the first occurrence of that marker in the outputs; before it, `allowed` is None (free)."""

    def __init__(self, matcher: Any, vocab: GrammarVocabulary, start_after: tuple[int, ...] | None = None):
        self._m, self.vocab = matcher, vocab
        self.marker = start_after
        self.start = None if start_after else 0  # where the grammar's output begins (None: the marker not yet seen)
        self.seen = 0  # outputs searched for the marker
        self.consumed = 0  # outputs fed to the matcher (from `start`)
        self._mask: np.ndarray | None = None  # the mask after `consumed` outputs
        self._bits = np.zeros(vocab.words, np.int32)

    def allowed(self, output: Sequence[int]) -> np.ndarray | None:
        if len(output) < max(self.seen, self.consumed):
            raise ValueError(f"a request's outputs never shrink: {len(output)} after {max(self.seen, self.consumed)}")
        if self.start is None:
            m = self.marker
            for i in range(max(self.seen, len(m) - 1), len(output)):  # only windows ending in the new outputs
                if tuple(output[i - len(m) + 1:i + 1]) == m:
                    self.start = self.consumed = i + 1
                    break
            self.seen = len(output)
            if self.start is None:
                return None
        if len(output) > self.consumed:
            for t in output[self.consumed:]:
                if not self._m.is_error():
                    self._m.consume_token(int(t))
            self.consumed, self._mask = len(output), None
        if self._mask is None:
            self._mask = self._compute()
        return self._mask

    def _compute(self) -> np.ndarray:
        V = self.vocab.vocab_size
        mask = np.zeros(V, bool)
        if not self._m.is_error():
            self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:V].astype(bool)
        if self._m.is_error() or not mask.any():
            mask[:] = False
            mask[list(self.vocab.eos_ids)] = True
        return mask

    @property
    def done(self) -> bool:
        """Whether the grammar is complete (only EOS may follow)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


def compile_grammar(vocab: GrammarVocabulary, kind: str, spec: Any, **options: Any) -> Grammar:
    """`grammar_text` compiled into a `Grammar` (a ValueError naming the problem: an invalid schema, regex or
    grammar)."""
    return Grammar(vocab, grammar_text(kind, spec, **options), kind)
