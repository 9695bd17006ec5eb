"""The Pallas GDN kernels (interpret mode on CPU) against their XLA twins, and compiled for TPU7x at 397B shapes.

Tolerances: float32 runs do the same maths as the twins in another order (a block-doubling inverse instead of
a triangular solve, fused sums), <= 1.3e-6 seen on O(1) values; 1e-5 leaves ~8x room and still catches a wrong
decay, slot or chunk boundary (those are O(0.1-1)). bf16 runs compare after the same bf16 roundings on both
sides, so one bf16 ulp (2^-8 relative) of the stored value bounds the difference.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.bench.kernels_gdn import random_gdn_inputs
from qwen35_lib.engine.batch import RaggedMeta, SeqWork, pack, stack_ranks
from qwen35_lib.kernels.gdn import native as gdn_native
from qwen35_lib.kernels.gdn import pallas as gdn_pallas
from qwen35_lib.kernels.gdn import xla as gdn_xla
from qwen35_lib.kernels.native import build as native
from tests import aot_subprocess

pallas_dense = jax.jit(gdn_pallas.gdn_dense_pallas, static_argnames="chunk_size")
xla_recurrent = jax.jit(gdn_xla.gdn_recurrent)
xla_chunked = jax.jit(gdn_xla.gdn_chunked, static_argnames="chunk_size")
pallas_ragged = jax.jit(jax.vmap(gdn_pallas.gdn_ragged_pallas))
xla_ragged = jax.jit(jax.vmap(gdn_xla.gdn_ragged_xla))
HEADS = dict(Hk=2, Hv=4, dk=16, dv=24)  # GVA: value head h reads key head h // 2


def _state(key, lead, Hv, dk, dv, dtype=jnp.float32, **_):
    return (0.3 * jax.random.normal(key, (*lead, Hv, dk, dv))).astype(dtype)


@pytest.mark.parametrize("T", [1, 100])
def test_dense_matches_recurrent_and_chunked(T):
    """T = 1 runs the decode kernel, T = 100 (not a multiple of 64) the chunk kernel over 2 rows x 2 chunks
    (seen: 3e-7 on outputs and 4e-7 on states, the same as XLA's own chunked form vs its recurrence)."""
    x = random_gdn_inputs(jax.random.key(T), (2, T), **HEADS)
    s0 = _state(jax.random.key(7), (2,), **HEADS)
    o, s = pallas_dense(*x, s0)
    o_r, s_r = xla_recurrent(*x, s0)
    np.testing.assert_allclose(o, o_r, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, s_r, atol=1e-5, rtol=1e-5)
    if T > 1:
        o_c, s_c = xla_chunked(*x, s0)
        np.testing.assert_allclose(o, o_c, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(s, s_c, atol=1e-5, rtol=1e-5)


def test_unit_lower_inverse_is_stable_where_neumann_is_not():
    """Nearly equal unit keys with beta ~ 1: A = strict_tril(beta k kᵀ) has powers that grow like binomials, so
    the Neumann product (I - A)(I + A²)(I + A⁴)... loses everything in float32 (seen: errors ~5e10), while the
    block-doubling inverse only forms blocks of the inverse itself (seen: exact to float32 rounding)."""
    C = 64
    keys = jax.random.normal(jax.random.key(0), (1, 16)) + 1e-3 * jax.random.normal(jax.random.key(1), (C, 16))
    keys = keys / jnp.linalg.norm(keys, axis=-1, keepdims=True)
    A = jnp.tril(0.999 * keys @ keys.T, -1)  # [C, C]
    L, eye = A + jnp.eye(C), jnp.eye(C)
    np.testing.assert_allclose(gdn_pallas.unit_lower_inverse(A) @ L, eye, atol=1e-5)
    neumann, power = eye - A, A
    for _ in range(5):
        power = power @ power
        neumann = neumann @ (eye + power)
    assert np.abs(neumann @ L - eye).max() > 1.0


def test_dense_aligned_keys_stay_accurate():
    """The same near-aligned keys through the whole chunk kernel (beta -> 1, no decay) vs the recurrence."""
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(3), (2, 100), **HEADS)
    k = jnp.broadcast_to(k[:, :1], k.shape) + 1e-3 * k
    beta, g = jnp.full_like(beta, 0.999), jnp.zeros_like(g)
    s0 = _state(jax.random.key(4), (2,), **HEADS)
    o, s = pallas_dense(q, k, v, g, beta, s0)
    o_r, s_r = xla_recurrent(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o, o_r, atol=1e-5, rtol=1e-5)  # seen: 5e-7 (o) and 1.3e-6 (state)
    np.testing.assert_allclose(s, s_r, atol=1e-5, rtol=1e-5)


def _meta(ranks, D=4, T=4 + 4 * 64, S=4):
    """(tokens, RaggedMeta) with a leading rank axis from [(decodes, prefills)] per rank."""
    return stack_ranks([pack(dec, pre, D=D, T=T, S=S, max_pages=1, chunk=64) for dec, pre in ranks])


# decodes (continuing, new, padding) and prefill chunks that start mid-sequence (from a slot state), start a new
# sequence, end off the 64-grid, and a padding chunk
RANKS = [([SeqWork([1], 10, [1], 1), SeqWork([1], 0, [1], 2)],  # decode continuing slot 1; a new 1-token sequence
          [SeqWork([1] * 100, 70, [1], 3), SeqWork([1] * 30, 0, [1], 4)]),  # mid-sequence 100 tokens; new 30
         ([SeqWork([1], 5, [1], 4)], [SeqWork([1] * 130, 64, [1], 2)])]  # rank 1: 1 decode; 130 from position 64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_matches_xla(dtype):
    """Both ranks at once (the model vmaps the ragged kernel over data-parallel ranks); activations and state
    in `dtype`. Outputs are compared at real tokens, states at every slot but the null slot 0."""
    dt = jnp.dtype(dtype)
    _, meta = _meta(RANKS)
    meta = jax.tree.map(jnp.asarray, meta)
    R, T = meta.token_seq.shape
    valid = meta.token_seq >= 0  # [R, T]
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(0), (R, T), **HEADS, dtype=dt)
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
    states = _state(jax.random.key(1), (R, 6), **HEADS, dtype=dt)  # 6 slots per rank
    o, s = pallas_ragged(q, k, v, g, beta, states, meta)
    o_x, s_x = xla_ragged(q, k, v, g, beta, states, meta)
    assert o.dtype == o_x.dtype == dt and s.dtype == dt
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=2**-8, rtol=2**-8)
    o, o_x = np.asarray(o, np.float32), np.asarray(o_x, np.float32)
    np.testing.assert_allclose(o[np.asarray(valid)], o_x[np.asarray(valid)], **tol)
    np.testing.assert_allclose(np.asarray(s[:, 1:], np.float32), np.asarray(s_x[:, 1:], np.float32), **tol)
    assert not np.allclose(np.asarray(s[:, 1:], np.float32), np.asarray(states[:, 1:], np.float32))


def test_ragged_in_tpu_interpret_mode():
    """The same ragged step under Pallas's TPU interpreter, which simulates VMEM blocks, the DMA pipeline (a block
    is written back when its index changes), uninitialised memory (NaN here) and data races: the slot reads and
    writes through index maps and the state carried in scratch hold there too."""
    from jax.experimental.pallas import tpu as pltpu

    _, meta = _meta(RANKS)
    meta = jax.tree.map(jnp.asarray, meta)
    R, T = meta.token_seq.shape
    valid = meta.token_seq >= 0
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(0), (R, T), **HEADS)
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
    states = _state(jax.random.key(1), (R, 6), **HEADS)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    fn = jax.jit(jax.vmap(partial(gdn_pallas.gdn_ragged_pallas, interpret=params)))
    o, s = jax.block_until_ready(fn(q, k, v, g, beta, states, meta))
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # private: where the flag lives

    assert ipc.races is not None and not ipc.races.races_found
    o_x, s_x = xla_ragged(q, k, v, g, beta, states, meta)
    np.testing.assert_allclose(np.asarray(o)[np.asarray(valid)], np.asarray(o_x)[np.asarray(valid)], atol=1e-5,
                               rtol=1e-5)
    np.testing.assert_allclose(s[:, 1:], s_x[:, 1:], atol=1e-5, rtol=1e-5)


def _verify_case(D=2, V=3, prefill=8, ranks=2):
    """Two ranks of D decode rows of V tokens (rank 1's last row padding) and a prefill of `prefill` tokens in
    chunks of 8; random state and checkpoint pools (a slot's old checkpoints are overwritten, never read)."""
    from tests.kernels.gdn.test_xla import _verify_meta

    metas = [_verify_meta(D, V, prefill), _verify_meta(D, V, prefill)]
    metas[-1] = metas[-1]._replace(decode_seq=metas[-1].decode_seq.copy())
    metas[-1].decode_seq[D - 1] = -1
    metas[-1].token_seq[(D - 1) * V:D * V] = -1
    meta = jax.tree.map(lambda *x: jnp.stack([jnp.asarray(a) for a in x]), *metas[:ranks])
    valid = meta.token_seq >= 0
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(0), valid.shape, **HEADS)
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
    pools = _state(jax.random.key(1), (ranks, D + 2), **HEADS), _state(jax.random.key(2), (ranks, D + 2, V), **HEADS)
    return (q, k, v, g, beta), meta, pools, np.asarray(valid)


def _verified(fn, x, meta, pools, **kw):
    return jax.jit(jax.vmap(lambda *a: fn(*a[:-1], chunk_size=8, checkpoints=a[-1], **kw)))(*x, pools[0], meta,
                                                                                              pools[1])


def test_verify_matches_xla():
    """Speculative verification (V = 3 tokens a decode row, a padding row, a prefill in the same step, two ranks):
    outputs, states (the null slot aside) and the checkpoints equal the XLA twin's (`gdn_ragged_xla(...,
    checkpoints=)`), the null slot's included (both write a padding row's there)."""
    x, meta, pools, valid = _verify_case()
    o, s, c = _verified(gdn_pallas.gdn_ragged_pallas, x, meta, pools)
    o_x, s_x, c_x = _verified(gdn_xla.gdn_ragged_xla, x, meta, pools)
    np.testing.assert_allclose(np.asarray(o)[valid], np.asarray(o_x)[valid], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s[:, 1:], s_x[:, 1:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(c, c_x, atol=1e-5, rtol=1e-5)
    assert not np.allclose(c[:, 1:4], pools[1][:, 1:4])  # the rows' checkpoints were written


def test_verify_in_tpu_interpret_mode():
    """The verify kernel under the TPU interpreter (VMEM blocks, the checkpoint pool in HBM never read: NaN if it
    were uninitialised and read, races detected), one rank of 2 rows of 2 tokens, no prefill."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # private: where the flag lives
    from jax.experimental.pallas import tpu as pltpu

    x, meta, pools, valid = _verify_case(D=2, V=2, prefill=0, ranks=1)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    o, s, c = jax.block_until_ready(_verified(gdn_pallas.gdn_ragged_pallas, x, meta, pools, interpret=params))
    assert ipc.races is not None and not ipc.races.races_found
    o_x, s_x, c_x = _verified(gdn_xla.gdn_ragged_xla, x, meta, pools)
    np.testing.assert_allclose(np.asarray(o)[valid], np.asarray(o_x)[valid], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s[:, 1:], s_x[:, 1:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(c, c_x, atol=1e-5, rtol=1e-5)


def test_model_and_engine_run_with_pallas_gdn():
    """The tiny model with gdn_kernel="pallas" matches `forward` with the XLA kernels:
    1. `forward` (the dense protocol) on right-padded rows A (100 tokens) and B (6);
    2. the engine's ragged step (the ragged protocol): step 1 prefills A's first 70 tokens (2 chunks) and B's 5;
       step 2 decodes B next to A's remaining 30, a chunk that starts mid-sequence from A's slot state."""
    from qwen35_lib import forward
    from qwen35_lib.engine.cache import CacheShape, init_cache
    from qwen35_lib.model.ragged import ragged_forward
    from qwen35_lib.parallel.parallelism import parallelism
    from qwen35_lib.plan import SINGLE

    cfg = cfg_xla = get_config("qwen3.5-tiny", dtype="float32")
    pallas = SINGLE.replace(gdn_kernel="pallas")
    w = init_weights(cfg, 0)
    rng = np.random.default_rng(1)
    seqs = {"A": rng.integers(0, 256, 100).tolist(), "B": rng.integers(0, 256, 6).tolist()}
    ids = np.zeros((2, 100), np.int32)
    ids[0], ids[1, :6] = seqs["A"], seqs["B"]
    lengths = np.array([100, 6])
    ref = np.asarray(forward(cfg_xla, w, ids, lengths))  # [2, 100, V]
    out = np.asarray(forward(cfg, w, ids, lengths, plan=pallas))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(out[b, :n], ref[b, :n], atol=2e-5, rtol=2e-5)

    ref = {"A": ref[0], "B": ref[1]}
    cache = init_cache(cfg, CacheShape(ranks=1, num_pages=40, page_size=8, num_slots=4))
    pages, slots = {"A": list(range(1, 14)), "B": [14]}, {"A": 1, "B": 2}
    work = lambda n, a, b: SeqWork(seqs[n][a:b], a, pages[n], slots[n])
    step = jax.jit(lambda cfg, *args: ragged_forward(cfg, *args, parallelism(pallas)), static_argnums=0)
    for decodes, prefills in [([], [("A", 0, 70), ("B", 0, 5)]), ([("B", 5, 6)], [("A", 70, 100)])]:
        tokens, meta = stack_ranks([pack([work(*d) for d in decodes], [work(*p) for p in prefills], D=2, T=194,
                                         S=2, max_pages=13, chunk=64)])
        logits, cache = step(cfg, w, cache, jnp.asarray(tokens), jax.tree.map(jnp.asarray, meta))
        for s, (n, _, b) in enumerate(decodes + prefills):
            np.testing.assert_allclose(logits[0, s], ref[n][b - 1], atol=2e-5, rtol=2e-5)


GDN397 = dict(Hk=16, Hv=64, dk=128, dv=128, NS=9, D=8, S=8)


def _compile_ragged_for_tpu7x(state_dtype: str, D: int = GDN397["D"], chunks: int = 4) -> dict:  # in aot_subprocess's
    from qwen35_lib.aot import topology_devices  # child: libtpu stays there

    one = jax.sharding.SingleDeviceSharding(topology_devices()[0])
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=one)
    Hk, Hv, dk, dv, NS, _, S = GDN397.values()
    T = D + chunks * 64
    args = (sds((T, Hk, dk), "bfloat16"), sds((T, Hk, dk), "bfloat16"), sds((T, Hv, dv), "bfloat16"),
            sds((T, Hv), "float32"), sds((T, Hv), "float32"), sds((NS, Hv, dk, dv), state_dtype))
    i32 = lambda *shape: sds(shape, "int32")
    meta = RaggedMeta(token_seq=i32(T), positions=i32(T), q_start=i32(S), q_len=i32(S), kv_len=i32(S),
                      page_table=i32(S, 4), slot=i32(S), decode_seq=i32(D), sample_tok=i32(S))
    fn = jax.jit(partial(gdn_pallas.gdn_ragged_pallas, interpret=False), donate_argnums=5)
    compiled = fn.lower(*args, meta).compile()
    hlo = compiled.as_text()
    return dict(kernels=[k for k in ("gdn_chunk", "gdn_decode") if k in hlo],
                alias_bytes=compiled.memory_analysis().alias_size_in_bytes)


def _compile_verify_for_tpu7x(state_dtype: str, D: int = GDN397["D"], V: int = 4) -> dict:  # in the same child
    """The ragged step's decode region as a verification (D rows of V tokens, checkpoints [NS, V, Hv, dk, dv])."""
    from qwen35_lib.aot import topology_devices

    one = jax.sharding.SingleDeviceSharding(topology_devices()[0])
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=one)
    Hk, Hv, dk, dv, NS, _, S = GDN397.values()
    T = D * V
    args = (sds((T, Hk, dk), "bfloat16"), sds((T, Hk, dk), "bfloat16"), sds((T, Hv, dv), "bfloat16"),
            sds((T, Hv), "float32"), sds((T, Hv), "float32"), sds((NS, Hv, dk, dv), state_dtype),
            sds((NS, V, Hv, dk, dv), state_dtype))
    i32 = lambda *shape: sds(shape, "int32")
    meta = RaggedMeta(token_seq=i32(T), positions=i32(T), q_start=i32(S), q_len=i32(S), kv_len=i32(S),
                      page_table=i32(S, 4), slot=i32(S), decode_seq=i32(D), sample_tok=i32(S))
    fn = jax.jit(lambda q, k, v, g, b, st, ck, meta: gdn_pallas.gdn_ragged_pallas(
        q, k, v, g, b, st, meta, interpret=False, checkpoints=ck), donate_argnums=(5, 6))
    compiled = fn.lower(*args, meta).compile()
    hlo = compiled.as_text()
    return dict(kernels=[k for k in ("gdn_chunk", "gdn_decode", "gdn_verify") if k in hlo],
                alias_bytes=compiled.memory_analysis().alias_size_in_bytes,
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes)


@pytest.fixture(scope="module")
def tpu7x():
    jobs = {dt: (_compile_ragged_for_tpu7x, dt) for dt in ("float32", "bfloat16")}
    jobs["verify"] = (_compile_verify_for_tpu7x, "bfloat16")  # tpu-inference's state dtype, the sweep's
    # the serving mixed step's rank: 64 decodes + 1,024 prompt tokens (Mosaic refused the decode kernel's 8-head
    # blocks of these bf16 operands, a half sublane tile, once XLA laid them out in (16, 128) tiles)
    jobs["mixed"] = (_compile_ragged_for_tpu7x, "bfloat16", 64, 16)
    return aot_subprocess.run(jobs)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "mixed"])
def test_kernels_compile_for_tpu7x_at_397b(tpu7x, state_dtype):
    """Both kernels (decode + chunk, inside the ragged step) lowered by Mosaic for one TPU7x core at the 397B GDN
    shapes (Hk 16, Hv 64, dk = dv = 128, chunk 64): 8 decodes + 4 prefill chunks, 9 state slots."""
    compiled = tpu7x[state_dtype]
    assert "error" not in compiled, compiled
    assert compiled["kernels"] == ["gdn_chunk", "gdn_decode"]  # both Mosaic custom calls are in the program
    item = jnp.dtype("bfloat16" if state_dtype == "mixed" else state_dtype).itemsize
    state_bytes = GDN397["NS"] * GDN397["Hv"] * GDN397["dk"] * GDN397["dv"] * item
    assert compiled["alias_bytes"] >= state_bytes  # the slot pool is updated in place


@pytest.mark.tpu_compile
def test_verify_kernel_compiles_for_tpu7x_at_397b(tpu7x):
    """The verify kernel lowered by Mosaic for one TPU7x core at the 397B GDN shapes: 8 rows of 4 tokens (k = 3),
    bf16 state and checkpoints; both pools updated in place (no copy of either)."""
    compiled = tpu7x["verify"]
    assert "error" not in compiled, compiled
    assert compiled["kernels"] == ["gdn_verify"]
    state = GDN397["NS"] * GDN397["Hv"] * GDN397["dk"] * GDN397["dv"] * 2
    assert compiled["alias_bytes"] >= state * (1 + 4)
    assert compiled["temp_bytes"] < state  # no temporary copy of a pool


def test_bench_rows_smoke():
    """`gdn_rows` at tiny size, decode only: one row per implementation, the Pallas row labelled interpret."""
    from qwen35_lib.bench.kernels_gdn import gdn_rows

    rows = gdn_rows("qwen3.5-tiny", cases=("decode",), decode_batch=2, dtype="float32", repeats=1, settle=0)
    native_row = ["native"] if native.load(gdn_native.LIBRARY) is not None else []  # the CPU's C++ kernels
    assert [r["implementation"] for r in rows] == ["xla", "pallas", *native_row]
    assert "interpret" in rows[1]["mode"] and rows[1]["max_abs_diff_vs_xla"] < 1e-5
