"""The XLA attention twin against a NumPy re-statement of causal GQA softmax attention; the page write's lane layout
and FP8 scales; paged attention over shuffled pages against the dense twin, token by token and by items."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.engine.batch import SeqWork, pack
from qwen35_lib.kernels.attention.xla import (
    ITEM_COST,
    attention_xla,
    by_context,
    kv_values,
    kv_words,
    paged_attention_items,
    paged_attention_xla,
    query_block,
    write_kv_pages,
)
from qwen35_lib.weights import FP8_MAX

RNG = np.random.default_rng(0)
B, T, HQ, HKV, D = 2, 7, 4, 2, 8


def _numpy_attention(q, k, v, lengths):
    """Query head h of row b at t: softmax over keys s <= t, s < lengths[b], of KV head h // (HQ // HKV)."""
    o = np.zeros_like(q)
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            for h in range(q.shape[2]):
                kh = h // (q.shape[2] // k.shape[2])
                keys = np.arange(q.shape[1])
                keys = keys[(keys <= t) & (keys < lengths[b])]
                s = k[b, keys, kh] @ q[b, t, h] / np.sqrt(q.shape[3])
                p = np.exp(s - s.max())
                o[b, t, h] = (p / p.sum()) @ v[b, keys, kh]
    return o


@pytest.fixture(scope="module")
def qkv():
    return [RNG.standard_normal(s).astype(np.float32) for s in ((B, T, HQ, D), (B, T, HKV, D), (B, T, HKV, D))]


def test_dense_attention_is_causal_gqa_softmax(qkv):
    q, k, v = qkv
    lengths = np.array([7, 4])
    got = np.asarray(jax.jit(attention_xla)(q, k, v, jnp.asarray(lengths)))
    np.testing.assert_allclose(got, _numpy_attention(q, k, v, lengths), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:, 0], np.repeat(v[:, 0], HQ // HKV, axis=1), rtol=1e-6)  # one key: its value


def test_query_blocks_equal_the_whole_score_matrix():
    """Rows past one query block (300 = 128 + 128 + 44 queries; a row of 170 real tokens ends inside the second)
    against the NumPy statement, and the block size: 128, at most 32 blocks."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 300, h, 16)).astype(np.float32) for h in (HQ, HKV, HKV))
    lengths = np.array([300, 170])
    got = np.asarray(jax.jit(attention_xla)(q, k, v, jnp.asarray(lengths)))
    want = _numpy_attention(q, k, v, lengths)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got[1, :170], want[1, :170], rtol=2e-5, atol=2e-6)  # past a row's length: padding
    assert [query_block(t) for t in (7, 300, 4096, 8192)] == [128, 128, 128, 256]


def test_write_puts_k_then_v_of_each_head_in_the_tokens_page_lanes(qkv):
    _, k, v = qkv
    k, v = k[0, :3], v[0, :3]  # 3 tokens
    page, offset = jnp.array([2, 2, 0]), jnp.array([1, 3, 0])  # the last one padding: the null page
    pages, scales = write_kv_pages(jnp.zeros((3, 4, 2 * HKV * D)), None, k, v, page, offset)
    pages = np.asarray(pages)
    assert scales is None
    for t, (p, o) in enumerate([(2, 1), (2, 3)]):
        for h in range(HKV):
            np.testing.assert_array_equal(pages[p, o, 2 * h * D:(2 * h + 1) * D], k[t, h])
            np.testing.assert_array_equal(pages[p, o, (2 * h + 1) * D:(2 * h + 2) * D], v[t, h])
    untouched = np.ones(pages.shape[:2], bool)
    untouched[[2, 2, 0], [1, 3, 0]] = False
    assert not pages[untouched].any()


def test_fp8_write_scales_each_token_and_head_to_the_full_range(qkv):
    _, k, v = qkv
    k, v = k[0, :2], v[0, :2]
    pages, scales = write_kv_pages(jnp.zeros((2, 4, 2 * HKV * D), jnp.float8_e4m3fn), jnp.zeros((2, 2 * HKV, 4)),
                                   k, v, jnp.array([1, 1]), jnp.array([0, 2]))
    scales = np.asarray(scales)
    kv = np.stack([k, v], axis=2).reshape(2, 2 * HKV, D)  # rows 2h (K) and 2h + 1 (V)
    np.testing.assert_allclose(scales[1, :, [0, 2]], np.abs(kv).max(-1) / FP8_MAX, rtol=1e-6)
    back = np.asarray(pages[1, [0, 2]].astype(jnp.float32)).reshape(2, 2 * HKV, D) * scales[1, :, [0, 2]][..., None]
    np.testing.assert_allclose(back, kv, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits
    assert np.abs(np.asarray(pages[1, [0, 2]].astype(jnp.float32))).max() == FP8_MAX  # each row reaches 448


@pytest.mark.parametrize("paged", [paged_attention_xla, paged_attention_items], ids=["xla", "items"])
def test_a_word_stored_fp8_pool_holds_and_gives_the_same_bits(qkv, paged):
    """The FP8 pool as uint32 words (the XLA attention's on a TPU: `kv_words`): four values a word, the write lands
    the same bits, and paged attention over it equals attention over the FP8 pool bit for bit."""
    q, k, v = qkv
    x = jnp.asarray(RNG.standard_normal((3, 16)), jnp.float8_e4m3fn)
    w = kv_words(x)
    assert w.shape == (3, 4) and w.dtype == jnp.uint32
    assert np.array_equal(np.asarray(kv_values(w)).view(np.uint8), np.asarray(x).view(np.uint8))
    assert int(w[0, 0]) == int.from_bytes(np.asarray(x[0, :4]).tobytes(), "little")  # the first value: the low byte
    seq, pos = np.array([0] * 7 + [1] * 4), np.array(list(range(7)) + list(range(4)))
    page_table, ps = jnp.array([[5, 1, 3], [2, 4, 0]]), 3
    page = np.asarray(page_table)[seq, pos // ps]
    out = {}
    for stored in (jnp.float8_e4m3fn, jnp.uint32):
        width = 2 * HKV * D // (4 if stored == jnp.uint32 else 1)
        kv, scales = write_kv_pages(jnp.zeros((6, ps, width), stored), jnp.ones((6, 2 * HKV, ps)), k[seq, pos],
                                    v[seq, pos], page, pos % ps)
        out[stored] = kv if stored == jnp.float8_e4m3fn else kv_values(kv), scales, np.asarray(
            jax.jit(paged)(q[seq, pos], kv, scales, page_table, seq, pos))
    (a, sa, oa), (b, sb, ob) = out.values()
    assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_array_equal(sa, sb)
    np.testing.assert_array_equal(oa, ob)


@pytest.mark.parametrize("paged", [paged_attention_xla, paged_attention_items], ids=["xla", "items"])
def test_paged_attention_over_shuffled_pages_is_the_dense_attention(qkv, paged):
    """Two sequences (lengths 7 and 4) in pages of 3 at scattered page ids; every token as a query (by items: one
    block of 16 tokens, 3 items for 11 tokens, 21 pages a step)."""
    q, k, v = qkv
    lengths, ps = [7, 4], 3
    page_table = jnp.array([[5, 1, 3], [2, 4, 0]])
    assert ITEM_COST * (1 + 2) < sum(lengths)  # items run (not the twin)
    tokens = [(b, t) for b in range(B) for t in range(lengths[b])]
    seq, pos = np.array([b for b, _ in tokens]), np.array([t for _, t in tokens])
    page = np.asarray(page_table)[seq, pos // ps]

    @jax.jit
    def attend(q, k, v):
        kv, _ = write_kv_pages(jnp.zeros((6, ps, 2 * HKV * D)), None, k, v, page, pos % ps)
        return paged(q, kv, None, page_table, seq, pos)

    got = attend(q[seq, pos], k[seq, pos], v[seq, pos])
    want = _numpy_attention(q, k, v, np.array(lengths))[seq, pos]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.float8_e4m3fn])
@pytest.mark.parametrize("block, keys, rows", [(16, 64, 64), (5, 6, 64), (5, 6, 3)])
def test_items_equal_the_twin_over_an_engine_batch(kv_dtype, block, keys, rows):
    """The engine's packing (3 decodes, then prefill chunks aligned to 16 tokens, padding between and after), pages
    of 3 at shuffled ids, an FP8 cache too: items (blocks of 16 or 5, runs cut by sequence and block; walking in
    groups of 3 items by context too) give every token what the token-by-token twin gives, and padding tokens 0."""
    rng, ps, num_pages = np.random.default_rng(1), 3, 64
    free = [int(p) for p in rng.permutation(np.arange(1, num_pages))]
    works = [SeqWork([1] * n, start, [free.pop() for _ in range(-(-(start + n) // ps))], 0)
             for start, n in ((4, 1), (12, 1), (0, 1), (0, 20), (9, 13), (2, 5))]
    _, meta = pack(works[:3], works[3:], D=4, T=4 + 3 * 32, S=7, max_pages=8, chunk=16)
    k, v = (rng.standard_normal((num_pages * ps, HKV, D)).astype(np.float32) for _ in range(2))
    every = np.repeat(np.arange(num_pages), ps), np.tile(np.arange(ps), num_pages)
    scales = jnp.ones((num_pages, 2 * HKV, ps)) if kv_dtype == jnp.float8_e4m3fn else None
    kv, scales = write_kv_pages(jnp.zeros((num_pages, ps, 2 * HKV * D), kv_dtype), scales, k, v, *every)
    q = jnp.asarray(rng.standard_normal((meta.token_seq.size, HQ, D)), jnp.float32)
    assert ITEM_COST * (-(-100 // block) + 7) < 100  # items run (not the twin)
    args = (q, kv, scales, *(jnp.asarray(a) for a in (meta.page_table, meta.token_seq, meta.positions)))
    want = np.asarray(paged_attention_xla(*args))
    got = np.asarray(paged_attention_items(*args, block=block, keys=keys, rows=rows))
    valid = meta.token_seq >= 0
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-6)
    assert not got[~valid].any() and (~valid).sum() > 20


def test_items_give_nan_for_more_runs_than_items():
    """Tokens of two sequences interleaved (64 runs for 4 blocks + 2 sequences: not the engine's packing) give NaN,
    not a wrong answer."""
    rng, ps = np.random.default_rng(2), 4
    kv = jnp.asarray(rng.standard_normal((20, ps, 2 * HKV * D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((64, HQ, D)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, 17)).reshape(2, 8))
    out = paged_attention_items(q, kv, None, table, jnp.arange(64) % 2, jnp.arange(64) // 2)
    assert np.isnan(np.asarray(out)).all()
    ordered = paged_attention_items(q, kv, None, table, jnp.arange(64) // 32, jnp.arange(64) % 32)  # 4 runs
    assert np.isfinite(np.asarray(ordered)).all()


def test_each_group_of_rows_walks_to_its_own_last_position():
    """`by_context` sorts rows by their last position and walks each group of `rows` to the group's own last: a
    walk that returns its group's loop length gives each row the largest last position among its sorted group, in
    the rows' own order; N <= rows walks once."""
    last = jnp.asarray(RNG.permutation(10) * 10)  # 0, 10, ..., 90 shuffled
    walked = np.asarray(by_context(lambda x: jnp.broadcast_to(jnp.max(x), x.shape), last, last, rows=4))
    group_max = {0: 30, 10: 30, 20: 30, 30: 30, 40: 70, 50: 70, 60: 70, 70: 70, 80: 90, 90: 90}
    assert walked.tolist() == [group_max[int(x)] for x in last]
    assert sum(walked) < 0.7 * 10 * 90  # against every row walking to the longest
    once = np.asarray(by_context(lambda x: jnp.broadcast_to(jnp.max(x), x.shape), last, last, rows=10))
    assert (once == 90).all()


@pytest.mark.parametrize("paged", [paged_attention_xla, paged_attention_items], ids=["xla", "items"])
def test_tokens_walking_in_groups_by_context_give_the_dense_attention(paged):
    """Nine sequences of 1-23 tokens, each token a query, in groups of 4 rows by context (the twin's tokens, the
    items' items of blocks of 8): every token attends to its own sequence's keys up to its position, against
    NumPy."""
    rng, ps = np.random.default_rng(3), 4
    lengths = [1, 23, 5, 17, 2, 9, 14, 3, 20]
    pages = rng.permutation(np.arange(1, 1 + sum(-(-n // ps) for n in lengths)))
    table, used = np.zeros((len(lengths), 6), np.int32), 0
    for s_, n in enumerate(lengths):
        table[s_, :-(-n // ps)] = pages[used:used + -(-n // ps)]
        used += -(-n // ps)
    seq = np.concatenate([[s_] * n for s_, n in enumerate(lengths)])
    pos = np.concatenate([np.arange(n) for n in lengths])
    q = rng.standard_normal((seq.size, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((seq.size, HKV, D)).astype(np.float32) for _ in range(2))
    kv, _ = write_kv_pages(jnp.zeros((used + 1, ps, 2 * HKV * D)), None, k, v, table[seq, pos // ps], pos % ps)
    kw = {"rows": 4} | ({"block": 8, "keys": 4} if paged is paged_attention_items else {})
    assert ITEM_COST * (-(-seq.size // 8) + len(lengths)) < seq.size  # items run (not the twin)
    got = np.asarray(paged(jnp.asarray(q), kv, None, jnp.asarray(table), jnp.asarray(seq), jnp.asarray(pos), **kw))
    for t in range(seq.size):
        same = np.flatnonzero((seq == seq[t]) & (pos <= pos[t]))
        for h in range(HQ):
            s_ = k[same, h // (HQ // HKV)] @ q[t, h] / np.sqrt(D)
            p_ = np.exp(s_ - s_.max())
            np.testing.assert_allclose(got[t, h], (p_ / p_.sum()) @ v[same, h // (HQ // HKV)], rtol=2e-5, atol=2e-6)
