"""Causal GQA attention in plain XLA: the reference twin of the `attention` slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.registry import AttentionKernels, register
from qwen35_lib.weights import FP8_MAX


def attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """Causal attention over right-padded rows.

    q: [B, T, Hq, d]; k, v: [B, T, Hkv, d] (after norms and RoPE); lengths: [B] real tokens per row.
    Query head h uses KV head h // (Hq // Hkv). Returns o: [B, T, Hq, d] in q's dtype.
    1. heads leading, once: q [B, Hkv, T*G, d] (row t*G + g: query t of head g of the group), k, v [B, Hkv, T, d];
    2. per block of `query_block(T)` queries [t0, t1): scores against keys [0, t1) only (a later key is in the
       future of every query in the block), q kᵀ / sqrt(d) in float32   # [B, Hkv, (t1-t0)*G, t1]
    3. mask keys in the future or beyond the row's length; softmax in float32, then p v.
    Equal to the whole [T, T] score matrix at once (the keys a block leaves out are masked there); the blocks
    skip the causal upper triangle and keep each block's scores in cache (qwen3.5-mini's shape on XLA:CPU,
    float32: 1x2048 340 -> 66 ms a layer, 1x512 9.4 -> 3.0 ms, 4x256 6.6 -> 3.7 ms, same run).
    """
    B, T, Hq, d = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    qt = q.reshape(B, T, Hkv, G, d).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, d)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, d]
    block = query_block(T)
    outs = []
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        s = jnp.einsum("bkrd,bksd->bkrs", qt[:, :, t0 * G:t1 * G], kt[:, :, :t1],
                       preferred_element_type=jnp.float32) * d**-0.5  # [B, Hkv, (t1-t0)*G, t1]
        t, u = jnp.repeat(jnp.arange(t0, t1), G), jnp.arange(t1)
        valid = (u[None, :] <= t[:, None])[None] & (u < lengths[:, None])[:, None, :]  # [B, rows, t1]
        s = jnp.where(valid[:, None], s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkrs,bksd->bkrd", p, vt[:, :, :t1], preferred_element_type=jnp.float32))
    o = jnp.concatenate(outs, axis=2).reshape(B, Hkv, T, G, d)
    return o.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, d).astype(q.dtype)


def query_block(T: int) -> int:
    """Queries per block of `attention_xla`: 128 (the fastest of 64-256 measured), more for long rows so that the
    unrolled blocks stay at most 32."""
    return max(128, -(-T // 32))


WORD = 4  # 8-bit values a uint32 word of a word-stored pool holds


def kv_words(x: jax.Array) -> jax.Array:
    """8-bit values [..., n] as uint32 words [..., n / 4]: four consecutive values a word (a bitcast).

    How the XLA attention on a TPU stores an FP8 KV pool: XLA:TPU tiles an 8-bit array in 32 x 128 blocks of
    4-row words (T(32,128)(4,1)), and scatters single rows into it only after relaying the whole pool out to
    T(8,128) and back (2 SparseCore copies of the pool a layer: 28% of dp_ep's decode bytes at the 397B size);
    a uint32 pool's rows are whole words, scattered in place. The Pallas kernel DMAs the FP8 pool as it is."""
    return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // WORD, WORD), jnp.uint32)


def kv_values(w: jax.Array) -> jax.Array:
    """The inverse of `kv_words`: uint32 words [..., m] -> float8_e4m3fn [..., 4m]."""
    return jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn).reshape(*w.shape[:-1], w.shape[-1] * WORD)


def kv_width(kv_pages: jax.Array) -> int:
    """Values a token row of the pool holds (2*Hkv*d), word-stored (`kv_words`) or not."""
    return kv_pages.shape[-1] * (WORD if kv_pages.dtype == jnp.uint32 else 1)


def write_kv_pages(kv_pages, kv_scales, k, v, page, offset):
    """Store each token's K and V in its page: kv_pages [P, ps, 2*Hkv*d]; k, v [T, Hkv, d]; page, offset [T].

    K of head h goes to lanes [2h*d, (2h+1)*d), V to the next d (one page holds a token range of every head's K
    and V, so a kernel reads it with one contiguous DMA). Padding tokens point at the null page 0.
    An FP8 cache (kv_scales [P, 2*Hkv, ps] float32, else None) stores one scale per token and head at
    [page, 2h + j, offset] (token-minor: a page's scales of one head are one row): amax / 448, so every row uses
    the full e4m3 range; a uint32 pool [P, ps, 2*Hkv*d / 4] holds the FP8 values as words (`kv_words`).
    Returns (kv_pages, kv_scales).
    """
    T, Hkv, d = k.shape
    kv = jnp.stack([k, v], axis=2).reshape(T, 2 * Hkv, d)  # [T, 2*Hkv, d]
    if kv_scales is None:
        return kv_pages.at[page, offset].set(kv.reshape(T, 2 * Hkv * d).astype(kv_pages.dtype)), None
    kv32 = kv.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(kv32), axis=-1), 1e-12) / FP8_MAX  # [T, 2*Hkv]
    q = (kv32 / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(T, 2 * Hkv * d)
    q = kv_words(q) if kv_pages.dtype == jnp.uint32 else q.astype(kv_pages.dtype)
    return kv_pages.at[page, offset].set(q), kv_scales.at[page, :, offset].set(scale)


def _page_kv(kv_pages, kv_scales, pages, d: int):
    """K and V of `pages` [N] in float32, dequantized: [N, ps, Hkv, d] each (a word-stored pool's pages as values)."""
    N, ps, H2d = pages.shape[0], kv_pages.shape[1], kv_width(kv_pages)
    kv = kv_pages[pages]  # [N, ps, H2d] (or its words [N, ps, H2d / 4])
    kv = (kv_values(kv) if kv.dtype == jnp.uint32 else kv).reshape(N, ps, H2d // d, d).astype(jnp.float32)
    if kv_scales is not None:
        kv = kv * kv_scales[pages].transpose(0, 2, 1)[..., None]  # [N, ps, 2*Hkv, 1]
    return kv[:, :, 0::2], kv[:, :, 1::2]


WALK_ROWS = 16  # rows (tokens of the twin, items of the items' walk) that walk the pages together


def by_context(walk, last: jax.Array, *xs: jax.Array, rows: int = WALK_ROWS) -> jax.Array:
    """`walk(*xs)` with each row reading its own context, not the batch's longest: rows sorted by their last
    position `last` [N], in groups of `rows` (zero rows padding the last), each group's walk to its own last page
    (`walk` takes its loop's length from its rows), outputs back in the rows' order. A row's walk past its own
    context adds nothing (its keys are masked), so the result is the one walk's up to float32 rounding; the pages
    read fall from N x the longest context to about N x (each row's own + the spread / groups).

    xs: arrays [N, ...] (row i of each is row i's); walk: xs' groups [rows, ...] -> [rows, ...]. N <= rows: one walk.
    """
    N = last.shape[0]
    if N <= rows:
        return walk(*xs)
    order = jnp.argsort(last)  # [N]
    n = -(-N // rows)
    grouped = [jnp.pad(x[order], [(0, n * rows - N)] + [(0, 0)] * (x.ndim - 1)).reshape(n, rows, *x.shape[1:])
               for x in xs]  # [n, rows, ...]
    out = jax.lax.map(lambda g: walk(*g), grouped)  # [n, rows, ...]
    return out.reshape(n * rows, *out.shape[2:])[:N][jnp.argsort(order)]


def paged_attention_xla(q, kv_pages, kv_scales, page_table, token_seq, positions, rows: int = WALK_ROWS):
    """Attention of flat ragged tokens over the paged KV cache (the new tokens' K/V already written): the slot's
    reference twin, token by token.

    q: [T, Hq, d]; kv_pages: [P, ps, 2*Hkv*d] (+ kv_scales [P, 2*Hkv, ps] for FP8, else None);
    page_table: [S, max_pages] (page ids of each sequence); token_seq, positions: [T] (a token sees its
    sequence's positions <= its own). Returns [T, Hq, d].
    Tokens in groups of WALK_ROWS by position (`by_context`), each group:
    1. loop over page j = 0 .. (the group's last page): gather each token's page j       # [rows, ps, 2*Hkv, d]
    2. scores of each KV head's query group against it, masked causally
    3. online softmax (running max m, sum l, accumulator acc), float32.
    """
    T, Hq, d = q.shape
    ps, Hkv = kv_pages.shape[1], kv_width(kv_pages) // (2 * d)
    G = Hq // Hkv
    qg = q.reshape(T, Hkv, G, d).astype(jnp.float32) * d**-0.5
    pages_of_token = page_table[jnp.clip(token_seq, 0)]  # [T, max_pages]

    def walk(qg, pages_of_token, positions):  # [rows, Hkv, G, d], [rows, max_pages], [rows]
        def body(j, carry):
            m, l, acc = carry  # [rows, Hkv, G], [rows, Hkv, G], [rows, Hkv, G, d]
            k, v = _page_kv(kv_pages, kv_scales, pages_of_token[:, j], d)  # [rows, ps, Hkv, d]
            s = jnp.einsum("tkgd,tskd->tkgs", qg, k)
            kv_pos = j * ps + jnp.arange(ps)
            s = jnp.where((kv_pos[None, :] <= positions[:, None])[:, None, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            scale = jnp.exp(m - m_new)
            return m_new, l * scale + p.sum(-1), acc * scale[..., None] + jnp.einsum("tkgs,tskd->tkgd", p, v)

        n = qg.shape[0]
        init = (jnp.full((n, Hkv, G), -jnp.inf), jnp.zeros((n, Hkv, G)), jnp.zeros((n, Hkv, G, d)))
        m, l, acc = jax.lax.fori_loop(0, jnp.max(positions) // ps + 1, body, init)
        return acc / l[..., None]

    o = by_context(walk, positions, qg, pages_of_token, positions, rows=rows)  # [T, Hkv, G, d]
    return o.reshape(T, Hq, d).astype(q.dtype)


ITEM_BLOCK = 16  # query tokens per item of `paged_attention_items`
ITEM_KEYS = 64  # keys per step of its loop (whole pages)
# what an item costs in tokens of the twin: items run where ITEM_COST x items < tokens. Measured 2.4 (qwen3.5-mini's
# attention shapes, float32: 64 decodes + a 64-token chunk, 73 items 66.0 ms against 128 tokens 47.6 ms)
ITEM_COST = 3


def paged_attention_items(q, kv_pages, kv_scales, page_table, token_seq, positions, block: int = ITEM_BLOCK,
                          keys: int = ITEM_KEYS, rows: int = WALK_ROWS):
    """`paged_attention_xla` by items (implementation "items", the CPU's): a page is read once per item, not
    once per token. An item is a run of consecutive tokens of one sequence inside one block of `block` tokens (a
    prefill chunk of L tokens is about L / block items, a decode token one of its own); a step has at most
    blocks + S items where each sequence's tokens are consecutive (the engine's `pack`; more runs give NaN, not a
    silently wrong answer). An item costs about ITEM_COST tokens of the twin (its block's rows computed whole), so
    where ITEM_COST x items is not fewer than the tokens (a decode step, or decodes with a short chunk) the twin runs
    instead. Equal to the twin up to float32 rounding.

    1. runs: a valid token starts one where its predecessor is another sequence or in another block; each run's
       block and sequence by scatter                                            # [W], W = blocks + S
    2. items in groups of WALK_ROWS by their last position (`by_context`), each group: loop over steps of `keys`
       keys (whole pages) up to its last page: each item's pages of the step, the scores of its block's rows
       against them                                                             # [rows, Hkv, block*G, keys]
       masked to (row in the run) & (key position <= row position); online softmax with a finite mask value
    3. token t takes row t % block of its run; padding tokens get 0.
    """
    if ITEM_COST * (-(-q.shape[0] // block) + page_table.shape[0]) >= q.shape[0]:  # items would cost more
        return paged_attention_xla(q, kv_pages, kv_scales, page_table, token_seq, positions, rows)
    T, Hq, d = q.shape
    ps, Hkv = kv_pages.shape[1], kv_width(kv_pages) // (2 * d)
    G, S = Hq // Hkv, page_table.shape[0]
    Tp = -(-T // block) * block
    nb, W = Tp // block, Tp // block + S
    seq_t = jnp.pad(token_seq.astype(jnp.int32), (0, Tp - T), constant_values=-1)  # [Tp]
    pos_t = jnp.pad(positions.astype(jnp.int32), (0, Tp - T))
    t = jnp.arange(Tp, dtype=jnp.int32)
    valid = seq_t >= 0
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), seq_t[:-1]])
    start = valid & ((t % block == 0) | (seq_t != prev))
    n_runs = jnp.sum(start, dtype=jnp.int32)
    run = jnp.where(valid, jnp.cumsum(start, dtype=jnp.int32) - 1, W)  # [Tp]; W: no item (dropped)
    lo = jnp.full((W,), Tp, jnp.int32).at[run].min(t, mode="drop")
    item_block = jnp.minimum(lo // block, nb - 1)  # [W]; unused items: the last block, fully masked
    item_seq = jnp.zeros((W,), jnp.int32).at[run].max(seq_t, mode="drop")
    pps = max(1, keys // ps)  # pages a step
    n = page_table.shape[1]
    item_pages = jnp.pad(page_table, ((0, 0), (0, -n % pps)))[item_seq]  # [W, steps*pps]; past the end: page 0

    qb = jnp.pad(q, ((0, Tp - T), (0, 0), (0, 0))).reshape(nb, block, Hkv, G, d).astype(jnp.float32) * d**-0.5
    qi = qb[item_block].transpose(0, 2, 1, 3, 4).reshape(W, Hkv, block * G, d)  # [W, Hkv, R, d], R = block*G
    row_tok = item_block[:, None] * block + jnp.arange(block)[None, :]  # [W, block]: each row's flat token
    in_run = jnp.repeat(run[row_tok] == jnp.arange(W)[:, None], G, axis=1)  # [W, R]
    row_pos = jnp.repeat(pos_t[row_tok], G, axis=1)  # [W, R]
    neg = jnp.finfo(jnp.float32).min
    last = jnp.max(jnp.where(in_run, row_pos, 0), axis=1)  # [W]: each item's last position

    def walk(qi, in_run, row_pos, item_pages, last):  # an items' group: [rows, Hkv, R, d], [rows, R] x2, ...
        w = qi.shape[0]

        def body(j, carry):
            m, l, acc = carry  # [w, Hkv, R], [w, Hkv, R], [w, Hkv, R, d]
            pages = jax.lax.dynamic_slice_in_dim(item_pages, j * pps, pps, axis=1).reshape(w * pps)
            k, v = (a.reshape(w, pps * ps, Hkv, d) for a in _page_kv(kv_pages, kv_scales, pages, d))  # [w, K, Hkv, d]
            s = jnp.einsum("wkrd,wskd->wkrs", qi, k)  # [w, Hkv, R, K], K = pps*ps keys
            key_pos = j * pps * ps + jnp.arange(pps * ps)
            mask = (in_run[..., None] & (key_pos <= row_pos[..., None]))[:, None]  # [w, 1, R, K]
            s = jnp.where(mask, s, neg)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            scale = jnp.exp(m - m_new)
            return m_new, l * scale + p.sum(-1), acc * scale[..., None] + jnp.einsum("wkrs,wskd->wkrd", p, v)

        init = (jnp.full((w, Hkv, block * G), neg), jnp.zeros((w, Hkv, block * G)),
                jnp.zeros((w, Hkv, block * G, d)))
        m, l, acc = jax.lax.fori_loop(0, jnp.max(last) // (pps * ps) + 1, body, init)
        return acc / jnp.where(l > 0, l, 1.0)[..., None]  # [w, Hkv, R, d]

    o = by_context(walk, last, qi, in_run, row_pos, item_pages, last, rows=rows)  # [W, Hkv, R, d]
    o = o.reshape(W, Hkv, block, G, d).transpose(0, 2, 1, 3, 4)  # [W, block, Hkv, G, d]
    out = o[jnp.minimum(run, W - 1), t % block]  # [Tp, Hkv, G, d]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    out = jnp.where(n_runs > W, jnp.nan, out)  # more runs than items: NaN, not a silently wrong answer
    return out[:T].reshape(T, Hq, d).astype(q.dtype)


@register("attention", "xla", per_platform=True)
def _xla(platform: str) -> AttentionKernels:  # on a TPU the FP8 pool is word-stored (`kv_words`)
    return AttentionKernels(dense=attention_xla, paged=paged_attention_xla, write=write_kv_pages,
                            kv_words=platform == "tpu")


@register("attention", "items", per_platform=True)
def _items(platform: str) -> AttentionKernels:
    return AttentionKernels(dense=attention_xla, paged=paged_attention_items, write=write_kv_pages,
                            kv_words=platform == "tpu")
