"""The Pallas ragged paged attention and KV-write kernels vs their XLA twins (interpret mode), the fused write +
attention call vs the two kernels (bit for bit), and their TPU7x ahead-of-time compile at the 397B shapes.

Batches are packed by the engine's own `pack` (decode region first, prefill chunks at chunk boundaries, padding),
so the kernels see exactly the layouts a step produces.

Tolerances: in float32 the kernel and the twin do the same float32 math (scores, online softmax, p v) and differ
only in summation order (the kernel groups `pages_per_step` pages per softmax update, the twin one page): a few
ulp of the output, so atol = rtol = 2e-5 (outputs are O(1)). FP8 caches use the same e4m3 values and the same
float32 scales in both: the twin dequantizes K and V rows first, the kernel scales the score and probability
columns of each key instead (q·(s_t k_t) = s_t (q·k_t), (p_t s_t) v_t = p_t (s_t v_t)): one float32 rounding
moved per product, a few ulp again, so the same bound holds. In bfloat16 both compute in float32 from exactly
representable products and round the output once to bfloat16; a rounding-boundary straddle costs 1 ulp
(2^-8 relative), so atol = rtol = 1e-2.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.engine.batch import SeqWork, pack
from qwen35_lib.kernels import get
from qwen35_lib.kernels.attention.pallas import (
    paged_attention_pallas,
    paged_attention_write_pallas,
    write_kv_pages_pallas,
)
from qwen35_lib.kernels.attention.xla import paged_attention_xla, write_kv_pages
from tests import aot_subprocess

HQ, HKV, D = 8, 2, 64  # CPU size: 4 query heads per KV head


def _batch(rng, ps: int, decodes: list[int], prefills: list[tuple[int, int]], T: int, chunk: int = 16,
           num_pages: int = 96):
    """A packed ragged batch: `decodes` = context length after the step of each decode, `prefills` = (start
    position, new tokens) of each prefill chunk. Pages are handed out shuffled. Returns (meta, page, offset)."""
    free = list(rng.permutation(np.arange(1, num_pages)))
    works = []
    for start, n in [(L - 1, 1) for L in decodes] + prefills:
        pages = [int(free.pop()) for _ in range(-(-(start + n) // ps))]
        works.append(SeqWork(tokens=[1] * n, start_pos=start, pages=pages, slot=0))
    S = len(works) + 1  # one unused sequence row
    max_pages = max(len(w.pages) for w in works) + 1
    _, meta = pack(works[: len(decodes)], works[len(decodes):], D=max(len(decodes), 1), T=T, S=S,
                   max_pages=max_pages, chunk=chunk)
    return (meta, *_rows(meta, ps))


def _case(seed, dtype, kv_dtype, ps, decodes, prefills, T, num_pages=96):
    """Random cache + queries + new K/V; both writes, then both attentions. Returns what the tests compare."""
    rng = np.random.default_rng(seed)
    meta, page, offset = _batch(rng, ps, decodes, prefills, T, num_pages=num_pages)
    fp8 = kv_dtype == jnp.float8_e4m3fn
    old = rng.standard_normal((2, num_pages * ps, HKV, D)).astype(np.float32)  # K and V of every cache row
    if fp8:  # quantize the old contents the way the write does, one scale per row and head
        every = np.repeat(np.arange(num_pages), ps), np.tile(np.arange(ps), num_pages)
        empty = jnp.zeros((num_pages, ps, 2 * HKV * D), kv_dtype), jnp.ones((num_pages, 2 * HKV, ps), jnp.float32)
        kv, scales = write_kv_pages(*empty, old[0], old[1], *every)
    else:
        kv, scales = jnp.asarray(np.stack([old[0], old[1]], 2).reshape(num_pages, ps, 2 * HKV * D), kv_dtype), None
    q = jnp.asarray(rng.standard_normal((T, HQ, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((T, HKV, D)), dtype) for _ in range(2))
    meta_j = jax.tree.map(jnp.asarray, meta)
    kv_x, sc_x = write_kv_pages(kv, scales, k, v, page, offset)
    kv_p, sc_p = write_kv_pages_pallas(kv, scales, k, v, page, offset)
    args = (meta_j.page_table, meta_j.token_seq, meta_j.positions)
    return meta, (kv_x, sc_x), (kv_p, sc_p), paged_attention_xla(q, kv_x, sc_x, *args), q, args


def _close(a, b, valid, tol):
    a, b = np.asarray(a, np.float32)[valid], np.asarray(b, np.float32)[valid]
    np.testing.assert_allclose(a, b, atol=tol, rtol=tol)


# (dtype, kv dtype, page size, decode context lengths, prefills (start, new tokens), T, block_q, pages_per_step)
CASES = {
    # decodes at position 0, at a page boundary and 100 pages deep mixed with prefills of odd lengths, one
    # continuing mid-page; T leaves padding tokens; block_q 8 splits the prefills mid-chunk
    "f32-mixed": (jnp.float32, jnp.float32, 8, [1, 16, 803], [(0, 37), (21, 19)], 112, 8, 4),
    "f32-one-page-steps": (jnp.float32, jnp.float32, 16, [5, 130], [(3, 45)], 80, 16, 1),
    "bf16-mixed": (jnp.bfloat16, jnp.bfloat16, 16, [1, 33, 257], [(0, 50), (70, 13)], 112, 16, None),
    "fp8-mixed": (jnp.float32, jnp.float8_e4m3fn, 16, [2, 17, 300], [(0, 29), (40, 20)], 96, 8, None),
    "decode-only": (jnp.float32, jnp.float32, 16, [1, 2, 15, 16, 17, 64, 200], [], 8, 8, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_xla(name):
    dtype, kv_dtype, ps, decodes, prefills, T, bq, pps = CASES[name]
    num_pages = 128 if name == "f32-mixed" else 96
    meta, (kv_x, sc_x), (kv_p, sc_p), ref, q, args = _case(0, dtype, kv_dtype, ps, decodes, prefills, T, num_pages)
    # the write: every real page identical (page 0, the null page, only takes padding and is never read)
    np.testing.assert_array_equal(np.asarray(kv_p[1:], np.float32), np.asarray(kv_x[1:], np.float32))
    if sc_x is not None:
        np.testing.assert_array_equal(np.asarray(sc_p[1:]), np.asarray(sc_x[1:]))
    out = paged_attention_pallas(q, kv_p, sc_p, *args, block_q=bq, pages_per_step=pps)
    valid = meta.token_seq >= 0
    _close(out, ref, valid, 1e-2 if dtype == jnp.bfloat16 else 2e-5)
    assert np.all(np.asarray(out, np.float32)[~valid] == 0)  # padding rows are zeros, never garbage


@pytest.mark.parametrize("ps,block_t", [(16, 4), (12, 32), (4, 8)])
def test_write_merges_rows_into_tiles(ps, block_t):
    """The write's read-modify-write of tiles (8 rows, or the whole page when ps is not a multiple of 8): runs of a
    prefill across tiles, pages and blocks of `block_t` tokens, next to decodes: every real page as the XLA twin."""
    rng = np.random.default_rng(1)
    meta, page, offset = _batch(rng, ps, [1, 9, 30], [(0, 29), (5, 22)], 80, num_pages=64)
    kv = jnp.asarray(rng.standard_normal((64, ps, 2 * HKV * D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((80, HQ, D)), jnp.float32)
    ref, _ = write_kv_pages(kv, None, *_new_kv(q), page, offset)
    out, _ = write_kv_pages_pallas(kv, None, *_new_kv(q), page, offset, block_t=block_t)
    np.testing.assert_array_equal(np.asarray(out[1:]), np.asarray(ref[1:]))


def test_dma_and_semaphores_under_tpu_interpret():
    """TPU interpret mode simulates VMEM, DMAs and semaphores: VMEM starts as NaN (so a row of a page that was
    never fetched, or a wait before its copy, would show), and the race detector watches the double buffer."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.experimental.pallas import tpu as pltpu

    meta, (kv_x, sc_x), _, ref, q, args = _case(0, jnp.float32, jnp.float8_e4m3fn, 16, [2, 40], [(0, 21)], 48)
    ip = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True)
    kv0, sc0 = kv_x, sc_x
    kv_p, sc_p = write_kv_pages_pallas(kv_x, sc_x, *_new_kv(q), *_rows(meta, 16), interpret=ip)
    assert not ipc.races.races_found
    kv_x, sc_x = write_kv_pages(kv_x, sc_x, *_new_kv(q), *_rows(meta, 16))
    np.testing.assert_array_equal(np.asarray(kv_p[1:], np.float32), np.asarray(kv_x[1:], np.float32))
    out = paged_attention_pallas(q, kv_p, sc_p, *args, block_q=8, pages_per_step=2, interpret=ip)
    assert not ipc.races.races_found
    _close(out, paged_attention_xla(q, kv_x, sc_x, *args), meta.token_seq >= 0, 2e-5)
    # the fused call: its step-0 tile writes and the items' page reads share the aliased pool
    out_f, kv_f, _ = paged_attention_write_pallas(q, *_new_kv(q), kv0, sc0, *_rows(meta, 16), *args, block_q=8,
                                                  pages_per_step=2, block_t=16, interpret=ip)
    assert not ipc.races.races_found
    np.testing.assert_array_equal(np.asarray(kv_f), np.asarray(kv_p))
    np.testing.assert_array_equal(np.asarray(out_f), np.asarray(out))


def _new_kv(q):
    """Fresh K and V [T, Hkv, d] derived from q (any values do)."""
    return q[:, :HKV] * 0.5, q[:, HKV:2 * HKV] - 1.0


def _rows(meta, ps):
    """(page, offset) [T] of each token, padding to the null page 0."""
    valid = meta.token_seq >= 0
    seq_pages = meta.page_table[np.clip(meta.token_seq, 0, None)]  # [T, max_pages]
    page = np.where(valid, seq_pages[np.arange(len(valid)), meta.positions // ps], 0)
    return page.astype(np.int32), np.where(valid, meta.positions % ps, 0).astype(np.int32)


def test_vmapped_over_ranks_like_the_model():
    """`model/attention.py` vmaps write and paged over data-parallel ranks: the Pallas pair batches too."""
    per_rank = [_case(s, jnp.float32, jnp.float32, 16, [3, 40], [(0, 21)], 48) for s in (1, 2)]
    stack = lambda *xs: jnp.stack([jnp.asarray(x) for x in xs])  # noqa: E731
    kv = stack(*(c[2][0] for c in per_rank))
    q = stack(*(c[4] for c in per_rank))
    args = [stack(*(c[5][i] for c in per_rank)) for i in range(3)]
    out = jax.vmap(paged_attention_pallas)(q, kv, None, *args)
    for r, c in enumerate(per_rank):
        _close(out[r], c[3], c[0].token_seq >= 0, 2e-5)


def test_non_contiguous_sequences_beyond_the_item_bound_give_nan():
    """Tokens of two sequences interleaved one by one make T runs (> T / block_q + S items): NaN, not wrong."""
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((4, 8, 2 * HKV * D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((8, HQ, D)), jnp.float32)
    ts = jnp.asarray([0, 1] * 4, jnp.int32)
    out = paged_attention_pallas(q, kv, None, jnp.asarray([[1], [2]], jnp.int32), ts, jnp.zeros(8, jnp.int32),
                                 block_q=8)
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize("kv_dtype,ps", [(jnp.bfloat16, 16), (jnp.float8_e4m3fn, 16), (jnp.bfloat16, 12),
                                         (jnp.float8_e4m3fn, 12)])
def test_fused_write_and_attention_equal_the_two_calls(kv_dtype, ps):
    """`paged_attention_write_pallas` (one call: the tile writes at grid step 0, then the items) against
    `write_kv_pages_pallas` then `paged_attention_pallas`: outputs, the whole pool (null page included) and the
    FP8 scales bit for bit. Decodes (one at a page boundary) next to a prefill chunk continuing its sequence
    mid-page, whose items read the pages this very call writes; ps 12 writes whole pages (not 8-row tiles)."""
    rng = np.random.default_rng(3)
    num_pages, T = 48, 64
    meta, page, offset = _batch(rng, ps, [1, ps + 1, 50], [(ps + 5, 27)], T, num_pages=num_pages)
    kv = jnp.asarray(rng.standard_normal((num_pages, ps, 2 * HKV * D)), kv_dtype)
    fp8 = kv_dtype == jnp.float8_e4m3fn
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (num_pages, 2 * HKV, ps)), jnp.float32) if fp8 else None
    q = jnp.asarray(rng.standard_normal((T, HQ, D)), jnp.bfloat16)
    k, v = _new_kv(q)
    args = tuple(jnp.asarray(a) for a in (meta.page_table, meta.token_seq, meta.positions))
    kv_ref, sc_ref = write_kv_pages_pallas(kv, scales, k, v, page, offset, block_t=16)
    ref = paged_attention_pallas(q, kv_ref, sc_ref, *args, block_q=8, pages_per_step=2)
    out, kv_out, sc_out = paged_attention_write_pallas(q, k, v, kv, scales, page, offset, *args, block_q=8,
                                                       pages_per_step=2, block_t=16)
    assert (out.dtype, kv_out.dtype) == (ref.dtype, kv_ref.dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    np.testing.assert_array_equal(np.asarray(kv_out, np.float32), np.asarray(kv_ref, np.float32))
    if fp8:
        np.testing.assert_array_equal(np.asarray(sc_out), np.asarray(sc_ref))
    else:
        assert sc_out is None
    # and the fused call did write before reading: attention over the old pool differs on the prefill's rows
    stale = paged_attention_pallas(q, kv, scales, *args, block_q=8, pages_per_step=2)
    assert not np.array_equal(np.asarray(stale, np.float32), np.asarray(out, np.float32))


def test_registered():
    impl = get("attention", "pallas")
    fn = lambda f: getattr(f, "func", f)  # off a TPU each kernel is registered in interpret mode (a partial)
    assert fn(impl.paged) is paged_attention_pallas and fn(impl.write) is write_kv_pages_pallas
    assert fn(impl.paged_write) is paged_attention_write_pallas
    assert get("attention", "xla").paged_write is None  # the XLA twin keeps write, then paged


def _abstract_397b(kv_dtype: str, ps: int):
    """Abstract inputs on one TPU7x core (libtpu: only in aot_subprocess's child) at Qwen3.5-397B: Hq 32, Hkv 2,
    d 256, one rank of dp8 at 512 concurrent requests of ~9k tokens: S 64 sequences, 576k cached tokens, T 512 new
    tokens. Returns (q, k, kv, scales [P, 2*Hkv, ps] (FP8 only, else None), page_table, ints [T], pool bytes)."""
    from jax.sharding import SingleDeviceSharding

    from qwen35_lib.aot import topology_devices

    sh = SingleDeviceSharding(topology_devices()[0])
    Hq, Hkv, d, T, S, ctx = 32, 2, 256, 512, 64, 9216
    n = ctx // ps
    P = S * n + 1
    kvd = jnp.dtype(kv_dtype)
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    kv = sds((P, ps, 2 * Hkv * d), kvd)
    scales = sds((P, 2 * Hkv, ps), jnp.float32) if kvd.itemsize == 1 else None
    pool = P * ps * 2 * Hkv * d * kvd.itemsize
    return (sds((T, Hq, d), jnp.bfloat16), sds((T, Hkv, d), jnp.bfloat16), kv, scales, sds((S, n), jnp.int32),
            sds((T,), jnp.int32), pool)


CACHES_397B = [("bfloat16", 16), ("float8_e4m3fn", 256)]  # (kv_dtype, page size)


def _compile_separate_for_tpu7x(kv_dtype: str, ps: int) -> dict:  # in aot_subprocess's child: libtpu stays there
    q, k, kv, scales, page_table, ints, pool = _abstract_397b(kv_dtype, ps)
    attn = jax.jit(lambda *a: paged_attention_pallas(*a, block_q=16, interpret=False))
    attn_c = attn.lower(q, kv, scales, page_table, ints, ints).compile()
    write = jax.jit(lambda *a: write_kv_pages_pallas(*a, interpret=False), donate_argnums=(0, 1))
    compiled = write.lower(kv, scales, k, k, ints, ints).compile()
    return dict(pool=pool, attn_temp=attn_c.memory_analysis().temp_size_in_bytes,
                write_temp=compiled.memory_analysis().temp_size_in_bytes, write_text=compiled.as_text())


def _compile_fused_for_tpu7x(kv_dtype: str, ps: int) -> dict:  # in aot_subprocess's child
    q, k, kv, scales, page_table, ints, pool = _abstract_397b(kv_dtype, ps)
    fused = jax.jit(lambda *a: paged_attention_write_pallas(*a, block_q=16, interpret=False), donate_argnums=(3, 4))
    compiled = fused.lower(q, k, k, kv, scales, ints, ints, page_table, ints, ints).compile()
    return dict(pool=pool, temp=compiled.memory_analysis().temp_size_in_bytes, text=compiled.as_text())


@pytest.fixture(scope="module")
def tpu7x():
    jobs = {f"{kind} {dt} {ps}": (fn, dt, ps) for dt, ps in CACHES_397B
            for kind, fn in (("separate", _compile_separate_for_tpu7x), ("fused", _compile_fused_for_tpu7x))}
    return aot_subprocess.run(jobs)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("kv_dtype,ps", CACHES_397B)
def test_compiles_for_tpu7x_at_397b_shapes(tpu7x, kv_dtype, ps):
    """Mosaic lowering (interpret off) for one TPU7x core at the 397B shapes (`_abstract_397b`)."""
    c = tpu7x[f"separate {kv_dtype} {ps}"]
    # the kernels read and write the pool in place: no relayout copy of it among the temporaries (a reshape of
    # its two minor dims would copy all of it), nor of kv_scale [P, 2*Hkv, ps] f32 (token-minor: lane-dense at
    # ps 256; stored [P, ps, 2*Hkv] it was relaid out on every call, a 302 MB temporary)
    assert c["attn_temp"] < c["pool"] / 8
    assert c["write_temp"] < c["pool"] / 8
    assert "kv_cache_write" in c["write_text"]


@pytest.mark.tpu_compile
@pytest.mark.parametrize("kv_dtype,ps", CACHES_397B)
def test_fused_compiles_for_tpu7x_at_397b_shapes(tpu7x, kv_dtype, ps):
    """The fused write + attention call lowered by Mosaic at the 397B shapes, the pool donated: one kernel, and
    no pool-sized temporary (the pool is aliased in place, the FP8 scales read and scattered in their layout)."""
    c = tpu7x[f"fused {kv_dtype} {ps}"]
    temp, pool = c["temp"], c["pool"]
    print(f"fused {kv_dtype} ps {ps}: temp {temp} bytes, pool {pool} bytes")
    assert temp < pool / 8
    text = c["text"]
    assert "ragged_paged_attention_kv_write" in text and "kv_cache_write" not in text


@pytest.mark.slow  # ~13 s alone, mostly compiling the tiny model's forward and ragged step
def test_engine_step_with_pallas_attention_matches_forward():
    """The whole tiny model through the engine's ragged step (prefill chunks, one mid-sequence, next to decodes),
    with the Pallas write and paged attention swapped in, against the full-sequence forward (float32)."""
    from qwen35_lib import forward, get_config, init_weights
    from qwen35_lib.plan import SINGLE
    from tests.model.test_ragged import run_schedule

    cfg = get_config("qwen3.5-tiny", dtype="float32")
    pallas = SINGLE.replace(attention_kernel="pallas")
    w = init_weights(cfg, 0)
    rng = np.random.default_rng(0)
    A, B = rng.integers(0, 256, 110).tolist(), rng.integers(0, 256, 20).tolist()
    ref = {"A": np.asarray(forward(cfg, w, np.array([A]), plan=pallas))[0],
           "B": np.asarray(forward(cfg, w, np.array([B]), plan=pallas))[0]}
    for logits, name, pos in run_schedule(cfg, w, A, B, plan=pallas):
        np.testing.assert_allclose(logits, ref[name][pos], atol=2e-5)
