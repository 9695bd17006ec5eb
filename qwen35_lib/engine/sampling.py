"""Sampling: greedy, temperature, top-k, top-p, with a per-request seed.

The random key of a token is `fold_in(key(seed), position)`: a request samples the same tokens whether it runs
alone or batched with others, and after a preemption and recompute.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids
    ignore_eos: bool = False

    def __post_init__(self):
        """Types first (a TypeError naming every wrong one), then ranges (a ValueError); numbers are stored as
        Python ints and floats (numpy scalars accepted), stop ids as a tuple."""
        ints = ("max_new_tokens", "top_k", "seed")
        wrong = [f"{f} must be an integer, got {getattr(self, f)!r}" for f in ints if not _is_int(getattr(self, f))]
        wrong += [f"{f} must be a number, got {getattr(self, f)!r}" for f in ("temperature", "top_p")
                  if not _is_real(getattr(self, f))]
        stop = self.stop_token_ids
        if stop is not None and (isinstance(stop, (str, bytes)) or not isinstance(stop, (tuple, list, range))
                                 or not all(_is_int(t) for t in stop)):
            wrong.append(f"stop_token_ids must be None or a sequence of integer token ids, got {stop!r}")
        if not isinstance(self.ignore_eos, bool):
            wrong.append(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if wrong:
            raise TypeError("invalid sampling parameters: " + "; ".join(wrong))
        for f in ints:
            object.__setattr__(self, f, int(getattr(self, f)))
        for f in ("temperature", "top_p"):
            object.__setattr__(self, f, float(getattr(self, f)))
        if stop is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not 0 <= self.seed < 2**32:
            problems.append(f"seed must be an integer in [0, 2**32), got {self.seed}")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))


def _is_int(x) -> bool:  # bool is an int in Python, not a count or an id
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seed: jax.Array,
           position: jax.Array) -> jax.Array:
    """Next tokens [N] from float32 logits [N, V] with per-row parameters [N].

    1. greedy rows (temperature 0) take the argmax; when every row is greedy that is all the step does
       (`lax.cond`: the sort over the vocabulary runs only for a batch with a sampled row);
    2. others scale by 1 / temperature, keep the top_k largest (if > 0), then the smallest set of tokens whose
       probability reaches top_p (the token that crosses it included), and draw with key fold_in(seed, position).
    """
    greedy = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    mixed = lambda logits: sample_sorted(logits, temperature, top_k, top_p, seed, position)
    return jax.lax.cond(jnp.all(temperature <= 0), greedy, mixed, logits)


def sample_sorted(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seed: jax.Array,
                  position: jax.Array) -> jax.Array:
    """`sample` for a batch with sampled rows: every row through the sort, greedy rows then take the argmax."""
    V = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [N, V] best first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = (top_k[:, None] == 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly before each token
    keep &= before < top_p[:, None]
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed.astype(jnp.uint32), position)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
