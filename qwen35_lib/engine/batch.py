"""The ragged batch of one engine step: flat tokens of many sequences, prefill chunks and decodes mixed.

Layout of one rank's T tokens (T = D + a multiple of C, C = the GDN chunk size):
- [0, D): the decode region: token i is the one new token of sequence i, for i < num_decode;
- [D, T): the prefill region: each other sequence's new tokens (a prompt chunk, possibly continuing a
  prompt) start at a multiple of C from D, so no C-chunk spans two sequences.
Sequences [0, num_decode) decode, the next ones prefill, the rest of the S rows are padding.
Unused tokens have token_seq = -1; unused sequences have q_len = kv_len = 0, page 0 and slot 0.

Speculative verification (`pack(..., width=V)`, V = k + 1 > 1): decode row i holds up to V tokens of sequence i
(its last sampled token and its drafts) at [i V, i V + q_len), the rest of the V padding; the decode region is
D V tokens, and `sample_tok` [S, V] names the V tokens whose logits are taken (a decode row's V places, its last
real one repeated; a prefill row's last token V times). `verify_width(meta)` reads V back (1: no verification).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class RaggedMeta(NamedTuple):
    """Per-rank metadata (each field gets a leading rank axis R in a step)."""

    token_seq: np.ndarray  # [T] sequence of each token, -1 for padding
    positions: np.ndarray  # [T] position of each token in its sequence
    q_start: np.ndarray  # [S] first flat token of each sequence
    q_len: np.ndarray  # [S] new tokens this step
    kv_len: np.ndarray  # [S] context after this step (previous + new)
    page_table: np.ndarray  # [S, max_pages] pages of each sequence (0 = null)
    slot: np.ndarray  # [S] GDN state slot (0 = null)
    decode_seq: np.ndarray  # [D] sequence of decode token i, -1 for padding; its length fixes D
    sample_tok: np.ndarray  # [S] flat index of each sequence's last new token (logits are taken there); [S, V]
    # when verifying drafts: each decode row's V tokens, a prefill row's last one V times


class SeqWork(NamedTuple):
    """What one sequence contributes to a step."""

    tokens: list[int]  # the new tokens (1 for a decode)
    start_pos: int  # position of tokens[0]
    pages: list[int]  # the sequence's pages, covering start_pos + len(tokens) tokens
    slot: int


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def verify_width(meta) -> int:
    """V, the tokens a decode row holds (1 + drafts verified: `pack(..., width=V)`), from the shape of
    `meta.sample_tok` (with or without a leading rank axis); 1 without speculation."""
    return meta.sample_tok.shape[-1] if meta.sample_tok.ndim > meta.q_len.ndim else 1


def pack(decodes: list[SeqWork], prefills: list[SeqWork], D: int, T: int, S: int, max_pages: int,
         chunk: int, width: int = 1) -> tuple[np.ndarray, RaggedMeta]:
    """One rank's (tokens [T], RaggedMeta) from its decodes (1 token each; up to `width` with drafts to verify) and
    prefill chunks. T counts the decode region of D x width tokens."""
    tokens = np.zeros(T, np.int32)
    meta = RaggedMeta(
        token_seq=np.full(T, -1, np.int32), positions=np.zeros(T, np.int32), q_start=np.zeros(S, np.int32),
        q_len=np.zeros(S, np.int32), kv_len=np.zeros(S, np.int32), page_table=np.zeros((S, max_pages), np.int32),
        slot=np.zeros(S, np.int32), decode_seq=np.full(D, -1, np.int32),
        sample_tok=np.zeros((S, width) if width > 1 else S, np.int32))
    if len(decodes) > D or len(decodes) + len(prefills) > S:
        raise ValueError(f"{len(decodes)} decodes + {len(prefills)} prefills do not fit D={D}, S={S}")
    offset = D * width
    for s, work in enumerate(decodes + prefills):
        n = len(work.tokens)
        if s < len(decodes):
            assert 1 <= n <= width, f"a decode has 1 to {width} tokens"
            first = s * width
            meta.decode_seq[s] = s
        else:
            first = offset
            offset += -(-n // chunk) * chunk
            if offset > T:
                raise ValueError(f"prefill tokens overflow the batch (T={T})")
        tokens[first : first + n] = work.tokens
        meta.token_seq[first : first + n] = s
        meta.positions[first : first + n] = work.start_pos + np.arange(n)
        meta.q_start[s], meta.q_len[s], meta.kv_len[s] = first, n, work.start_pos + n
        meta.page_table[s, : len(work.pages)] = work.pages
        meta.slot[s] = work.slot
        meta.sample_tok[s] = first + n - 1
        if width > 1 and s < len(decodes):
            meta.sample_tok[s, :n] = first + np.arange(n)
    return tokens, meta


def stack_ranks(per_rank: list[tuple[np.ndarray, RaggedMeta]]) -> tuple[np.ndarray, RaggedMeta]:
    """[R, ...] arrays from R per-rank packs of the same bucket."""
    tokens = np.stack([t for t, _ in per_rank])
    return tokens, RaggedMeta(*(np.stack(f) for f in zip(*(m for _, m in per_rank))))
