"""Sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seed; and vLLM's logits processing
(presence / frequency / repetition penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, and a grammar's
mask: structured outputs, `engine.structured`).

The random key of a token is `fold_in(key(seed), position)`: a request samples the same tokens whether it runs
alone or batched with others, and after a preemption and recompute.

Logits processing is batched: a step whose requests use none of it runs the plain sampler; one with any request
that does passes `processing_arrays` (dense [N, V] bias, output counts and prompt mask, per-row penalties), built
on the host from each request's prompt and outputs, and `process_logits` applies them in the step. Each piece
has a NumPy reference twin written from the definitions (`reference_logits`, `reference_keep`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids
    ignore_eos: bool = False
    min_p: float = 0.0  # keep tokens with probability >= min_p x the most likely one's (0: off)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # tokens in the prompt or output: positive logits / r, negative logits x r
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias) added to the logits
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None  # token sequences never completed in the output
    min_tokens: int = 0  # the stop and EOS ids are masked until this many tokens are out
    # structured outputs: a compiled grammar (`engine.structured.Grammar`, anything with `matcher()`); each request
    # gets a matcher of its own, whose mask keeps only the tokens the grammar allows next
    structured: Any = None

    def __post_init__(self):
        """Types first (a TypeError naming every wrong one), then ranges (a ValueError); numbers are stored as
        Python ints and floats (numpy scalars accepted), id lists as tuples."""
        wrong = self._type_errors()
        if wrong:
            raise TypeError("invalid sampling parameters: " + "; ".join(wrong))
        self._normalise()
        problems = self._range_errors()
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    _INTS = ("max_new_tokens", "top_k", "seed", "min_tokens")
    _REALS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

    def _type_errors(self) -> list[str]:
        wrong = [f"{f} must be an integer, got {getattr(self, f)!r}" for f in self._INTS
                 if not _is_int(getattr(self, f))]
        wrong += [f"{f} must be a number, got {getattr(self, f)!r}" for f in self._REALS
                  if not _is_real(getattr(self, f))]
        for f in ("stop_token_ids", "allowed_token_ids"):
            if not _ids_or_none(getattr(self, f)):
                wrong.append(f"{f} must be None or a sequence of integer token ids, got {getattr(self, f)!r}")
        bias = _pairs(self.logit_bias)
        if bias is not None and not (isinstance(bias, (tuple, list)) and all(
                isinstance(p, (tuple, list)) and len(p) == 2 and _is_int(p[0]) and _is_real(p[1]) for p in bias)):
            wrong.append(f"logit_bias must be None, a dict or (token id, bias) pairs, got {self.logit_bias!r}")
        bad = self.bad_words_ids
        if bad is not None and not (isinstance(bad, (tuple, list)) and all(_ids_or_none(w) and w is not None
                                                                            for w in bad)):
            wrong.append(f"bad_words_ids must be None or a sequence of token-id sequences, got {bad!r}")
        if not isinstance(self.ignore_eos, bool):
            wrong.append(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.structured is not None and not callable(getattr(self.structured, "matcher", None)):
            wrong.append(f"structured must be None or a compiled grammar (engine.structured), got "
                         f"{type(self.structured).__name__}")
        return wrong

    def _normalise(self) -> None:
        """Python ints and floats, id lists as tuples (the types checked already)."""
        for f in self._INTS:
            object.__setattr__(self, f, int(getattr(self, f)))
        for f in self._REALS:
            object.__setattr__(self, f, float(getattr(self, f)))
        for f in ("stop_token_ids", "allowed_token_ids"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, tuple(int(t) for t in getattr(self, f)))
        bias = _pairs(self.logit_bias)
        if bias is not None:
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.bad_words_ids is not None:
            object.__setattr__(self, "bad_words_ids", tuple(tuple(int(t) for t in w) for w in self.bad_words_ids))

    def _range_errors(self) -> list[str]:
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}"),
            (0 <= self.top_k < 2**31, f"top_k must be an integer >= 0 (0 = off) and < 2**31, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}"),
            *((-2 <= getattr(self, f) <= 2, f"{f} must be in [-2, 2] (0 = off), got {getattr(self, f)!r}")
              for f in ("presence_penalty", "frequency_penalty")),
            (0 < self.repetition_penalty <= 1e4,
             f"repetition_penalty must be in (0, 1e4] (1 = off), got {self.repetition_penalty!r}"),
            (self.logit_bias is None or all(math.isfinite(b) for _, b in self.logit_bias),
             "logit_bias values must be finite numbers"),
            (0 <= self.min_tokens <= self.max_new_tokens,
             f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}"),
            (0 <= self.seed < 2**32, f"seed must be an integer in [0, 2**32), got {self.seed}"),
        ]
        problems = [message for ok, message in checks if not ok]
        for f, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                       ("logit_bias", [t for t, _ in self.logit_bias or ()]),
                       ("bad_words_ids", [t for w in self.bad_words_ids or () for t in w])):
            if ids is not None and any(t < 0 for t in ids):
                problems.append(f"{f} must hold token ids >= 0, got {min(ids)}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            problems.append("allowed_token_ids must not be empty (None: every token)")
        if self.bad_words_ids is not None and not all(self.bad_words_ids):
            problems.append("bad_words_ids must not hold an empty sequence")
        return problems

    @property
    def processed(self) -> bool:
        """Whether the request needs logits processing (the [N, V] path of the step)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_ids)
                or self.min_tokens > 0 or self.structured is not None)

    def token_ids(self) -> dict[str, list[int]]:
        """The token ids the parameters name, by what they are (for the vocabulary check)."""
        return {"stop token": list(self.stop_token_ids or ()), "allowed_token_ids token": list(
            self.allowed_token_ids or ()), "logit_bias token": [t for t, _ in self.logit_bias or ()],
            "bad_words token": [t for w in self.bad_words_ids or () for t in w]}


def _pairs(bias):
    """logit_bias as given: a dict as its (token id, bias) items."""
    return tuple(bias.items()) if isinstance(bias, dict) else bias


def _is_int(x) -> bool:  # bool is an int in Python, not a count or an id
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _ids_or_none(ids) -> bool:
    return ids is None or (not isinstance(ids, (str, bytes)) and isinstance(ids, (tuple, list, range))
                           and all(_is_int(t) for t in ids))


# --- host side: one request's processing row -------------------------------------------------------------------
def banned_ids(params: SamplingParams, output: Sequence[int], stop_ids: Sequence[int]) -> set[int]:
    """Token ids masked for the next sample: min_tokens (stop and EOS ids, while fewer outputs) and bad words
    (the last id of a sequence whose other ids end the output; a one-id word always)."""
    banned: set[int] = set()
    if len(output) < params.min_tokens:
        banned |= set(stop_ids) | set(params.stop_token_ids or ())
    for word in params.bad_words_ids or ():
        k = len(word) - 1
        if k == 0 or (len(output) >= k and tuple(output[len(output) - k:]) == word[:-1]):
            banned.add(word[-1])
    return banned


def grammar_allowed(matcher: Any, output: Sequence[int], stop_ids: Sequence[int]) -> np.ndarray | None:
    """The tokens a request's grammar matcher (`engine.structured.Matcher`) allows after `output` (bool [V]; None:
    the grammar has not started, every token); where it allows the EOS ids (the grammar is complete), the request's
    own stop ids too (vLLM's stop_token_ids)."""
    allowed = matcher.allowed(output)
    if allowed is None:
        return None
    eos = list(matcher.vocab.eos_ids)
    if stop_ids and allowed[eos].any():
        allowed = allowed.copy()
        allowed[list(stop_ids)] = True
    return allowed


def fill_processing_row(arr: dict, i: int, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                        stop_ids: Sequence[int], matcher: Any = None) -> None:
    """Row i of `processing_arrays` for one request (numpy, in place): bias (logit_bias, -inf outside
    allowed_token_ids, outside the grammar's mask (`matcher`, structured outputs) and on `banned_ids`, unless the
    bans would leave no token the grammar allows: then the grammar wins), output counts, prompt mask, penalties."""
    V = arr["bias"].shape[-1]
    bias = arr["bias"][i]
    for t, b in params.logit_bias or ():
        bias[t] += np.float32(max(-100.0, min(100.0, b)))  # OpenAI clamps a bias to [-100, 100]
    if params.allowed_token_ids is not None:
        allowed = np.zeros(V, bool)
        allowed[list(params.allowed_token_ids)] = True
        bias[~allowed] = -np.inf
    grammar = None if matcher is None else grammar_allowed(matcher, output, stop_ids)
    if grammar is not None:
        bias[~grammar] = -np.inf
    banned = banned_ids(params, output, stop_ids)
    if banned and (grammar is None or grammar.sum() > np.count_nonzero(grammar[sorted(banned)])):
        bias[sorted(banned)] = -np.inf
    if output:
        arr["counts"][i] = np.bincount(np.asarray(output, np.int64), minlength=V)[:V]
    arr["prompt"][i, np.asarray(prompt, np.int64)] = True
    arr["presence"][i], arr["frequency"][i], arr["repetition"][i] = \
        params.presence_penalty, params.frequency_penalty, params.repetition_penalty


def processing_arrays(shape: tuple[int, ...], V: int) -> dict:
    """Neutral processing arrays for rows of `shape` (e.g. (R, S)) over a vocabulary of V: bias [..., V] f32,
    counts [..., V] i32, prompt [..., V] bool, presence / frequency / repetition [...] f32."""
    return dict(bias=np.zeros((*shape, V), np.float32), counts=np.zeros((*shape, V), np.int32),
                prompt=np.zeros((*shape, V), bool), presence=np.zeros(shape, np.float32),
                frequency=np.zeros(shape, np.float32), repetition=np.ones(shape, np.float32))


# --- device side -----------------------------------------------------------------------------------------------
def process_logits(logits: jax.Array, proc: dict) -> jax.Array:
    """Processed logits [N, V] (float32), vLLM's order:
    1. + bias (logit_bias; -inf on masked tokens: allowed_token_ids, bad words, min_tokens);
    2. repetition penalty on tokens in the prompt or the output: a positive logit divided by r, a negative one
       multiplied by r;
    3. - frequency x (count in the output) - presence x (1 if in the output)."""
    counts = proc["counts"].astype(jnp.float32)
    logits = logits + proc["bias"]
    rep = proc["repetition"][:, None]
    seen = proc["prompt"] | (proc["counts"] > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - proc["frequency"][:, None] * counts - proc["presence"][:, None] * (counts > 0)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seed: jax.Array,
           position: jax.Array, min_p: jax.Array | None = None, proc: dict | None = None) -> jax.Array:
    """Next tokens [N] from float32 logits [N, V] with per-row parameters [N].

    0. with `proc` (`processing_arrays`, rows [N]), the logits are processed first (`process_logits`);
    1. greedy rows (temperature 0) take the argmax; when every row is greedy that is all the step does
       (`lax.cond`: the sort over the vocabulary runs only for a batch with a sampled row);
    2. others scale by 1 / temperature, keep the tokens whose probability is at least min_p x the largest, the
       top_k largest (if > 0), then the smallest set of tokens whose probability (renormalized over those kept)
       reaches top_p (the token that crosses it included), and draw with key fold_in(seed, position).
    """
    if proc is not None:
        logits = process_logits(logits, proc)
    min_p = jnp.zeros_like(top_p) if min_p is None else min_p
    greedy = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    mixed = lambda logits: sample_sorted(logits, temperature, top_k, top_p, seed, position, min_p)
    return jax.lax.cond(jnp.all(temperature <= 0), greedy, mixed, logits)


def sample_sorted(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seed: jax.Array,
                  position: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
    """`sample` for a batch with sampled rows: every row through the sort, greedy rows then take the argmax."""
    greedy = jnp.argmax(logits, axis=-1)
    order, sorted_logits, keep = sorted_keep(logits, temperature, top_k, top_p, min_p)
    keys = token_keys(seed, position)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def token_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    """The random key of each token to sample (any shape): fold_in(key(seed), position), the request's own stream."""
    fold = lambda s, p: jax.random.fold_in(jax.random.key(s), p)
    return jax.vmap(fold)(seed.reshape(-1).astype(jnp.uint32), position.reshape(-1)).reshape(seed.shape)


def target_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                 min_p: jax.Array) -> jax.Array:
    """The distribution `sample` draws each row from [N, V] (vocabulary order): temperature, min_p, top_k and top_p
    applied (`sorted_keep`), renormalized; a greedy row's (temperature 0) is a point mass on its argmax."""
    order, sorted_logits, keep = sorted_keep(logits, temperature, top_k, top_p, min_p)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    probs = jax.vmap(lambda o, p: jnp.zeros_like(p).at[o].set(p))(order, probs)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=probs.dtype)
    return jnp.where((temperature > 0)[:, None], probs, greedy)


def sorted_keep(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                min_p: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(order [N, V] best first, the scaled logits in that order, which of them may be drawn [N, V] bool)."""
    V = logits.shape[-1]
    min_p = jnp.zeros_like(top_p) if min_p is None else min_p
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [N, V] best first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    full = jax.nn.softmax(sorted_logits, axis=-1)
    keep = full >= min_p[:, None] * full[:, :1]
    keep &= (top_k[:, None] == 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly before each token
    keep &= before < top_p[:, None]
    return order, sorted_logits, keep


# --- NumPy reference twins (tests) -----------------------------------------------------------------------------
def reference_logits(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                     stop_ids: Sequence[int], grammar: Sequence[bool] | None = None) -> np.ndarray:
    """One row's processed logits [V], from the definitions, token by token (float64); `grammar`: the tokens a
    grammar allows (bool [V])."""
    x = np.asarray(logits, np.float64).copy()
    for t, b in params.logit_bias or ():
        x[t] += max(-100.0, min(100.0, b))
    if params.allowed_token_ids is not None:
        for t in range(len(x)):
            if t not in params.allowed_token_ids:
                x[t] = -np.inf
    if grammar is not None:
        for t in range(len(x)):
            if not grammar[t]:
                x[t] = -np.inf
    banned = banned_ids(params, output, stop_ids)
    if grammar is None or any(grammar[t] and t not in banned for t in range(len(x))):
        for t in banned:
            x[t] = -np.inf
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    r = params.repetition_penalty
    for t in set(prompt) | set(counts):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    return x


def reference_keep(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Which tokens of processed logits [V] a sampled row may draw (bool [V]): temperature, min_p, top_k, top_p."""
    x = np.asarray(logits, np.float64) / max(params.temperature, 1e-6)
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= params.min_p * p.max()
    if params.top_k:
        keep &= x >= np.sort(x)[::-1][params.top_k - 1]
    order = sorted(np.flatnonzero(keep), key=lambda t: -x[t])
    q = p[order] / p[order].sum()
    mass, out = 0.0, np.zeros_like(keep)
    for t, pt in zip(order, q):
        if mass >= params.top_p:
            break
        out[t] = True
        mass += pt
    return out
