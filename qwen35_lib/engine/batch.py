"""The ragged batch of one engine step: flat tokens of many sequences, prefill chunks and decodes mixed.

Layout of one rank's T tokens (T = D + a multiple of C, C = the GDN chunk size):
- [0, D): the decode region: token i is the one new token of sequence i, for i < num_decode;
- [D, T): the prefill region: each other sequence's new tokens (a prompt chunk, possibly continuing a
  prompt) start at a multiple of C from D, so no C-chunk spans two sequences.
Sequences [0, num_decode) decode, the next ones prefill, the rest of the S rows are padding.
Unused tokens have token_seq = -1; unused sequences have q_len = kv_len = 0, page 0 and slot 0.
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
    sample_tok: np.ndarray  # [S] flat index of each sequence's last new token (logits are taken there)


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


def pack(decodes: list[SeqWork], prefills: list[SeqWork], D: int, T: int, S: int, max_pages: int,
         chunk: int) -> tuple[np.ndarray, RaggedMeta]:
    """One rank's (tokens [T], RaggedMeta) from its decodes (1 token each) and prefill chunks."""
    tokens = np.zeros(T, np.int32)
    meta = RaggedMeta(
        token_seq=np.full(T, -1, np.int32), positions=np.zeros(T, np.int32), q_start=np.zeros(S, np.int32),
        q_len=np.zeros(S, np.int32), kv_len=np.zeros(S, np.int32), page_table=np.zeros((S, max_pages), np.int32),
        slot=np.zeros(S, np.int32), decode_seq=np.full(D, -1, np.int32), sample_tok=np.zeros(S, np.int32))
    if len(decodes) > D or len(decodes) + len(prefills) > S:
        raise ValueError(f"{len(decodes)} decodes + {len(prefills)} prefills do not fit D={D}, S={S}")
    offset = D
    for s, work in enumerate(decodes + prefills):
        n = len(work.tokens)
        if s < len(decodes):
            assert n == 1, "a decode has one token"
            first = s
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
    return tokens, meta


def stack_ranks(per_rank: list[tuple[np.ndarray, RaggedMeta]]) -> tuple[np.ndarray, RaggedMeta]:
    """[R, ...] arrays from R per-rank packs of the same bucket."""
    tokens = np.stack([t for t, _ in per_rank])
    return tokens, RaggedMeta(*(np.stack(f) for f in zip(*(m for _, m in per_rank))))
