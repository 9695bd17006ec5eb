"""Log-probabilities for `logprobs`, `top_logprobs`, `echo` and `prompt_logprobs`: the model's forward over a whole
sequence (prompt + output), log-softmax over the vocabulary, as vLLM's default `raw_logprobs` (the model's own
distribution, before temperature, penalties and masks).

1. the sequence is right-padded to a bucket (powers of two from 32 up to max_model_len: few compiles) and run
   through the model's `forward_prepared` on the engine's weights: a program of its own beside the engine's step,
   which reads the weights and never the pools, so it runs on its own thread while the engine steps;
2. for each position t >= 1: the log-probability of token t given the tokens before it, its rank (1 + how many
   tokens are more likely), and the K most likely tokens with theirs (K = --max-logprobs, fixed: one compile per
   bucket);
3. the formatters shape them as the OpenAI completions API (`tokens`, `token_logprobs`, `top_logprobs`,
   `text_offset`), the chat API (`content`: [{token, logprob, bytes, top_logprobs}]) and vLLM's `prompt_logprobs`
   ([None, {id: {logprob, rank, decoded_token}}, ...]). A token's text is the tokenizer's decoding of it alone
   (special tokens kept), or `token_id:N` on a server without a tokenizer (vLLM's return_tokens_as_token_ids).
"""

from __future__ import annotations

import dataclasses
import threading
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.model.decoder import forward_prepared
from qwen35_lib.model.layer_loop import prepare_weights
from qwen35_lib.parallel.parallelism import parallelism


@dataclasses.dataclass
class Scores:
    """A sequence of L tokens scored: `token` [L - 1] and `rank` [L - 1] of tokens 1..L-1, `top_lp` / `top_ids`
    [L - 1, K] the K most likely tokens at positions 1..L-1 (each row predicts that position's token)."""

    token: np.ndarray
    rank: np.ndarray
    top_lp: np.ndarray
    top_ids: np.ndarray


@partial(jax.jit, static_argnums=(0, 1, 2))
def _score(cfg, par, k: int, weights: dict, ids: jax.Array, length: jax.Array):
    logits = forward_prepared(cfg, par, weights, ids, length)[0]  # [T, V] float32
    lp = jax.nn.log_softmax(logits[:-1], axis=-1)  # [T - 1, V]: row t predicts token t + 1
    nxt = ids[0, 1:]
    tok = jnp.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]  # [T - 1]
    rank = 1 + jnp.sum(lp > tok[:, None], axis=-1)  # [T - 1]
    top_lp, top_ids = jax.lax.top_k(lp, k)  # [T - 1, K]
    return tok, rank, top_lp, top_ids


class Scorer:
    """`Scorer(engine, k).score(ids)` -> `Scores`; one sequence at a time (a lock), on the caller's thread."""

    def __init__(self, engine: Any, k: int = 20, min_bucket: int = 32):
        if engine.mesh is not None:
            raise ValueError("log-probabilities are computed under --layout single only")
        self.config, self.k, self.max_len = engine.config, k, engine.ec.max_model_len
        self.weights = prepare_weights(engine.config, engine.weights, engine.plan)
        self.par = parallelism(engine.plan)
        self.min_bucket = min_bucket
        self._lock = threading.Lock()

    def bucket(self, n: int) -> int:
        b = self.min_bucket
        while b < n:
            b *= 2
        return max(min(b, self.max_len), n)

    def score(self, ids: list[int]) -> Scores:
        L = len(ids)
        if L < 2:
            return Scores(np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros((0, self.k), np.float32),
                          np.zeros((0, self.k), np.int32))
        T = self.bucket(L)
        row = np.zeros((1, T), np.int32)
        row[0, :L] = ids
        with self._lock:
            out = _score(self.config, self.par, min(self.k, self.config.vocab_size), self.weights, jnp.asarray(row),
                         jnp.asarray([L], jnp.int32))
            tok, rank, top_lp, top_ids = (np.asarray(x)[:L - 1] for x in out)
        return Scores(tok, rank, top_lp, top_ids)


# --- formatting ----------------------------------------------------------------------------------------------------
def token_text(text: Any, token: int) -> str:
    return f"token_id:{token}" if text is None else text.decode([int(token)], skip_special_tokens=False)


def _lp(x: float) -> float:
    return max(float(x), -9999.0)  # vLLM's clamp of -inf


def completion_logprobs(text: Any, ids: list[int], scores: Scores, start: int, k: int, first_none: bool,
                        offset: int = 0) -> dict:
    """The completions API's `logprobs` for ids[start:] of the scored sequence `ids` (top `k` per token, plus the
    token itself, as vLLM); `first_none`: ids[start] is the sequence's first token (echo), which has none."""
    out: dict[str, list] = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    last = 0
    for i in range(start, len(ids)):
        tok = token_text(text, ids[i])
        out["text_offset"].append(offset if not out["text_offset"] else out["text_offset"][-1] + last)
        last = len(tok)
        out["tokens"].append(tok)
        if i == 0 and first_none:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        r = i - 1
        out["token_logprobs"].append(_lp(scores.token[r]))
        top = {token_text(text, t): _lp(v) for t, v in zip(scores.top_ids[r][:k], scores.top_lp[r][:k])}
        top.setdefault(tok, _lp(scores.token[r]))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(text: Any, ids: list[int], scores: Scores, start: int, k: int) -> dict:
    """The chat API's `logprobs` ({"content": [...]}) for ids[start:] (start >= 1)."""
    def entry(token: int, lp: float) -> dict:
        s = token_text(text, token)
        return dict(token=s, logprob=_lp(lp), bytes=list(s.encode("utf-8", "replace")))

    content = []
    for i in range(start, len(ids)):
        r = i - 1
        e = entry(ids[i], scores.token[r])
        e["top_logprobs"] = [entry(t, v) for t, v in zip(scores.top_ids[r][:k], scores.top_lp[r][:k])]
        content.append(e)
    return {"content": content}


def prompt_logprobs(text: Any, prompt: list[int], scores: Scores, k: int) -> list:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}} with the
    prompt's token and the `k` most likely."""
    out: list = [None]
    for i in range(1, len(prompt)):
        r = i - 1
        d = {str(int(t)): dict(logprob=_lp(v), rank=j + 1, decoded_token=token_text(text, t))
             for j, (t, v) in enumerate(zip(scores.top_ids[r][:k], scores.top_lp[r][:k]))}
        d.setdefault(str(prompt[i]), dict(logprob=_lp(scores.token[r]), rank=int(scores.rank[r]),
                                          decoded_token=token_text(text, prompt[i])))
        out.append(d)
    return out
