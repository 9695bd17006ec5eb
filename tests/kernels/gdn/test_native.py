"""kernels.gdn.native: the C++ GDN decode step against per-row float64 math (continuing, fresh and padding rows,
untouched slots, float32 and bfloat16 inputs); the prefill handler against per-token float64 math (sequences from
a slot or from zero, tokens of no sequence, the scalar and the vectorised head sizes) and its dense form against
XLA's chunked and recurrent forms; the ragged protocol against the XLA twin on a mixed batch of two ranks; where it
cannot run (a bfloat16 state pool, a partitioned step) the XLA form runs; the engine's CPU default runs the handler.

Tolerances: float32 against float64 the rounding of a 64-term sum (1e-5 on O(1) values); the mixed batch as in
gdn/test_pallas (the same maths in another order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.bench.kernels_gdn import random_gdn_inputs
from qwen35_lib.kernels import get
from qwen35_lib.kernels.gdn import native as gdn_native
from qwen35_lib.kernels.gdn import xla as gdn_xla
from qwen35_lib.kernels.native import build as native
from tests.kernels.gdn.test_pallas import HEADS, RANKS, _meta, _state

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler: the native kernel cannot be built")

decode = jax.jit(gdn_native.gdn_decode_native)


def test_the_library_builds_and_loads():
    assert native.load(gdn_native.LIBRARY) is not None, native.unavailable(gdn_native.LIBRARY)


def per_row(q, k, v, g, beta, slot, start, states):
    """The delta rule's step for each row in float64 (NumPy); padding rows (slot < 0) from zero, not stored."""
    q, k, v, g, beta, states = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, states))
    states = states.copy()
    D, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    o = np.zeros((D, Hv, dv))
    for r in range(D):
        for h in range(Hv):
            kh = h // (Hv // Hk)
            qn = q[r, kh] / np.sqrt(q[r, kh] @ q[r, kh] + 1e-6) / np.sqrt(dk)
            kn = k[r, kh] / np.sqrt(k[r, kh] @ k[r, kh] + 1e-6)
            S = states[slot[r], h] if slot[r] >= 0 and start[r] else np.zeros((dk, dv))
            S = np.exp(g[r, h]) * S
            S = S + np.outer(kn, beta[r, h] * (v[r, h] - S.T @ kn))
            o[r, h] = S.T @ qn
            if slot[r] >= 0:
                states[slot[r], h] = S
    return o, states


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_equals_per_row_math(dtype):
    """Rows continuing from their slot, starting fresh (whatever the slot held is ignored) and padding; slots no
    row names, the null slot 0 among them, keep their contents."""
    D, NS = 6, 9
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(0), (D,), **HEADS, dtype=jnp.dtype(dtype))
    states = _state(jax.random.key(1), (NS,), **HEADS)
    slot = jnp.array([3, 1, -1, 7, 2, -1], jnp.int32)
    start = jnp.array([True, False, True, True, False, False])
    o, s = decode(q, k, v, g, beta, slot, start, states)
    want_o, want_s = per_row(q, k, v, g, beta, np.asarray(slot), np.asarray(start), states)
    assert o.dtype == s.dtype == jnp.float32
    np.testing.assert_allclose(o, want_o, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, want_s, atol=1e-5, rtol=1e-5)
    untouched = [0, 4, 5, 6, 8]
    np.testing.assert_array_equal(np.asarray(s)[untouched], np.asarray(states)[untouched])


def test_decode_equals_the_xla_form_and_updates_the_pool_in_place():
    """Equal to `gdn_decode_xla` (padding rows included; the pool but the null slot); with the pool donated, XLA
    aliases it to the result: the handler writes the slots in place, no copy of the pool."""
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(2), (8,), **HEADS)
    states = _state(jax.random.key(3), (11,), **HEADS)
    slot = jnp.array([3, 1, -1, 7, 2, -1, 10, 5], jnp.int32)
    start = jnp.array([True, False, False, True, True, False, True, False])
    o, s = decode(q, k, v, g, beta, slot, start, states)
    o_x, s_x = jax.jit(gdn_xla.gdn_decode_xla)(q, k, v, g, beta, slot, start, states)
    np.testing.assert_allclose(o, o_x, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s[1:], s_x[1:], atol=1e-5, rtol=1e-5)
    donated = jax.jit(gdn_native.gdn_decode_native, donate_argnums=7).lower(q, k, v, g, beta, slot, start, states)
    compiled = donated.compile()
    assert gdn_native.HANDLER in compiled.as_text()
    assert compiled.memory_analysis().alias_size_in_bytes >= states.nbytes


def per_sequence(q, k, v, g, beta, first, length, slot, start, states):
    """The prefill protocol in float64 (NumPy): each sequence's tokens in order through `per_row`'s step."""
    o = np.zeros(v.shape)
    states = np.asarray(states, np.float64)
    for f, n, sl, st in zip(first, length, slot, start):
        for t in range(f, f + n):
            rows = [np.asarray(x, np.float64)[t:t + 1] for x in (q, k, v, g, beta)]
            o_t, states = per_row(*rows, [sl], [st or t > f], states)
            o[t] = o_t[0]
    return o, states


@pytest.mark.parametrize("heads", [HEADS, dict(Hk=2, Hv=4, dk=64, dv=64)], ids=["scalar", "vectorised"])
def test_prefill_equals_per_token_math(heads):
    """Sequences continuing from their slot and starting fresh, one of no tokens, tokens of no sequence (their
    output 0); slots no sequence names keep their contents; the pool is updated in place when donated."""
    N, NS = 40, 7
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(10), (N,), **heads)
    states = _state(jax.random.key(11), (NS,), **heads)
    first, length = np.array([0, 13, 30, 5]), np.array([13, 9, 7, 0])
    slot, start = np.array([2, 5, 1, 3]), np.array([True, False, True, True])
    nothing = lambda q, k, v, *rest: (jnp.zeros(v.shape, jnp.float32), rest[-1])  # off the CPU (traced only)
    prefill = jax.jit(lambda *a: gdn_native.gdn_prefill_native(*a, fallback=nothing), donate_argnums=9)
    args = (q, k, v, g, beta, *map(jnp.asarray, (first, length, slot, start)))
    want_o, want_s = per_sequence(q, k, v, g, beta, first, length, slot, start, states)
    compiled = prefill.lower(*args, states).compile()
    assert gdn_native.PREFILL in compiled.as_text()
    assert compiled.memory_analysis().alias_size_in_bytes >= states.nbytes
    o, s = prefill(*args, jnp.copy(states))
    np.testing.assert_allclose(o, want_o, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(o)[22:30], 0.0)
    np.testing.assert_allclose(s, want_s, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(s)[[0, 3, 4, 6]], np.asarray(states)[[0, 3, 4, 6]])


@pytest.mark.parametrize("heads", [HEADS, dict(Hk=2, Hv=4, dk=64, dv=64)], ids=["scalar", "vectorised"])
def test_dense_matches_chunked_and_recurrent(heads):
    """The `native` dense kernel (each row a sequence through the prefill handler) against XLA's chunked form
    (what runs off the CPU) and its recurrence, 2 rows of 100 tokens from a state."""
    x = random_gdn_inputs(jax.random.key(12), (2, 100), **heads)
    s0 = _state(jax.random.key(13), (2,), **heads)
    lowered = jax.jit(get("gdn", "native").dense).lower(*x, s0)
    assert gdn_native.PREFILL in lowered.as_text()
    o, s = lowered.compile()(*x, s0)
    for o_x, s_x in (jax.jit(gdn_xla.gdn_chunked)(*x, s0), jax.jit(gdn_xla.gdn_recurrent)(*x, s0)):
        np.testing.assert_allclose(o, o_x, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(s, s_x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_matches_xla(dtype):
    """The `native` ragged kernel (both regions the handlers) against `xla` on two
    ranks of decodes (continuing, a new 1-token sequence, padding) and prefill chunks; the state pool float32."""
    _, meta = _meta(RANKS)
    meta = jax.tree.map(jnp.asarray, meta)
    R, T = meta.token_seq.shape
    valid = np.asarray(meta.token_seq >= 0)
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(4), (R, T), **HEADS, dtype=jnp.dtype(dtype))
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
    states = _state(jax.random.key(5), (R, 6), **HEADS)
    o, s = jax.jit(jax.vmap(get("gdn", "native").ragged))(q, k, v, g, beta, states, meta)
    o_x, s_x = jax.jit(jax.vmap(gdn_xla.gdn_ragged_xla))(q, k, v, g, beta, states, meta)
    assert o.dtype == o_x.dtype == jnp.dtype(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=2**-8, rtol=2**-8)
    np.testing.assert_allclose(np.asarray(o, np.float32)[valid], np.asarray(o_x, np.float32)[valid], **tol)
    np.testing.assert_allclose(s[:, 1:], s_x[:, 1:], atol=1e-5, rtol=1e-5)


def test_a_bfloat16_pool_runs_the_xla_form():
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(6), (4,), **HEADS)
    assert gdn_native.native_target(q, v, _state(jax.random.key(7), (5,), **HEADS, dtype=jnp.bfloat16),
                                     gdn_native.PREFILL) is None
    states = _state(jax.random.key(7), (5,), **HEADS, dtype=jnp.bfloat16)
    slot, start = jnp.array([1, 2, 3, 4], jnp.int32), jnp.array([True, True, False, True])
    assert gdn_native.native_target(q, v, states) is None
    lowered = jax.jit(gdn_native.gdn_decode_native).lower(q, k, v, g, beta, slot, start, states)
    assert gdn_native.HANDLER not in lowered.as_text()
    o, s = decode(q, k, v, g, beta, slot, start, states)
    o_x, s_x = jax.jit(gdn_xla.gdn_decode_xla)(q, k, v, g, beta, slot, start, states)
    np.testing.assert_array_equal(o, o_x)
    np.testing.assert_array_equal(s, s_x)


def test_the_cpu_default_is_native_and_traces_the_handler_alone():
    """A plan bound for the CPU gets the handlers told so: the program holds the custom call and no conditional
    over platforms (whose XLA branch, the chunked prefill form, was traced and lowered for nothing); called without
    a platform (directly), the lowering chooses, and a plan bound for another platform runs the XLA form."""
    from qwen35_lib.kernels import for_plan
    from qwen35_lib.plan import SINGLE

    kernels = for_plan("gdn", SINGLE.bound(None))
    for fn, want in ((kernels.ragged.keywords["decode"], gdn_native.gdn_decode_native),
                     (kernels.ragged.keywords["prefill"], gdn_native.gdn_prefill_native),
                     (kernels.dense, gdn_native.gdn_dense_native)):
        assert fn.func is want and fn.keywords == {"platform": "cpu"}
    B, T = 2, 8
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(0), (B, T), **HEADS, dtype=jnp.float32)
    state = _state(jax.random.key(1), (B,), **HEADS)
    program = {p: str(jax.make_jaxpr(lambda *a, p=p: gdn_native.gdn_dense_native(*a, platform=p))(
        q, k, v, g, beta, state)) for p in ("cpu", None, "gpu")}
    assert gdn_native.PREFILL in program["cpu"] and "platform_index" not in program["cpu"]
    assert gdn_native.PREFILL in program[None] and "platform_index" in program[None]
    assert gdn_native.PREFILL not in program["gpu"] and "platform_index" not in program["gpu"]


def test_a_step_xla_partitions_runs_the_xla_form():
    """Under a multi-device mesh (a layout's step, partitioned by XLA) the handler would have its operands gathered
    onto every device: the XLA form runs there instead."""
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(8), (4,), **HEADS)
    states = _state(jax.random.key(9), (5,), **HEADS)
    slot, start = jnp.array([1, 2, 3, 4], jnp.int32), jnp.array([True, True, False, True])
    args = (q, k, v, g, beta, slot, start, states)
    assert gdn_native.HANDLER in decode.lower(*args).as_text()
    x = random_gdn_inputs(jax.random.key(10), (2, 8), **HEADS)
    s0 = _state(jax.random.key(11), (2,), **HEADS)
    with jax.set_mesh(jax.make_mesh((len(jax.devices()),), ("x",))):
        assert gdn_native.HANDLER not in jax.jit(gdn_native.gdn_decode_native).lower(*args).as_text()
        assert gdn_native.PREFILL not in jax.jit(gdn_native.gdn_dense_native).lower(*x, s0).as_text()


def _verify_inputs(D, V, NS, key=20, dtype=jnp.float32, heads=HEADS):
    """D rows of V tokens (row 2's last token padding: g = beta = 0), a state pool of NS slots and its
    checkpoints, both random (what a slot held before is overwritten or kept, never read as zeros)."""
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(key), (D * V,), **heads, dtype=jnp.dtype(dtype))
    pad = jnp.zeros(D * V, bool).at[2 * V + V - 1].set(True)[:, None]
    g, beta = jnp.where(pad, 0.0, g), jnp.where(pad, 0.0, beta)
    states = _state(jax.random.key(key + 1), (NS,), **heads)
    ckpt = _state(jax.random.key(key + 2), (NS, V), **heads)
    return (q, k, v, g, beta), states, ckpt


@pytest.mark.parametrize("heads", [HEADS, dict(Hk=2, Hv=4, dk=64, dv=64)], ids=["scalar", "vectorised"])
def test_verify_equals_the_xla_form_in_place(heads):
    """Rows continuing, fresh, a padding row and a padding token: outputs, states and checkpoints equal
    `gdn_verify_xla`'s (but the null slot, which the handler leaves alone); slots no row names keep their contents;
    with the pools donated XLA aliases both to the results (no copy of either)."""
    D, V, NS = 5, 4, 8
    x, states, ckpt = _verify_inputs(D, V, NS, heads=heads)
    slot = jnp.array([3, 1, 6, -1, 2], jnp.int32)
    start = jnp.array([True, False, True, True, True])
    run = jax.jit(gdn_native.gdn_verify_native, donate_argnums=(7, 8))
    compiled = run.lower(*x, slot, start, states, ckpt).compile()
    assert gdn_native.VERIFY in compiled.as_text()
    assert compiled.memory_analysis().alias_size_in_bytes >= states.nbytes + ckpt.nbytes
    o, s, c = run(*x, slot, start, jnp.copy(states), jnp.copy(ckpt))
    o_x, s_x, c_x = jax.jit(gdn_xla.gdn_verify_xla)(*x, slot, start, states, ckpt)
    np.testing.assert_allclose(np.asarray(o)[:3 * V], np.asarray(o_x)[:3 * V], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(o)[4 * V:], np.asarray(o_x)[4 * V:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s[1:], s_x[1:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(c[1:], c_x[1:], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(c[6, V - 1], c[6, V - 2])  # the padding token: the state as it was
    untouched = [0, 4, 5, 7]
    np.testing.assert_array_equal(np.asarray(s)[untouched], np.asarray(states)[untouched])
    np.testing.assert_array_equal(np.asarray(c)[untouched], np.asarray(ckpt)[untouched])


def test_verify_checkpoints_are_bitwise_the_decode_steps():
    """Rollback is exact under the handlers: checkpoint n of a row is, bitwise, the state of decoding its first
    n + 1 tokens one step at a time with the decode handler (the k = 0 path), its last in the slot; through the
    `native` ragged kernel on two ranks (vmapped, as the model runs it), bfloat16 activations."""
    from tests.kernels.gdn.test_xla import _verify_meta

    D, V, NS = 3, 4, 6
    meta = jax.tree.map(lambda x: jnp.stack([jnp.asarray(x)] * 2), _verify_meta(D, V))
    x, states, ckpt = _verify_inputs(D * 2, V, NS, key=30, dtype=jnp.bfloat16)
    ranks = lambda a: a.reshape(2, D * V, *a.shape[1:])
    x, states, ckpt = tuple(map(ranks, x)), jnp.stack([states, -states]), jnp.stack([ckpt, ckpt])
    ragged = jax.jit(jax.vmap(lambda *a: get("gdn", "native").ragged(*a[:-1], chunk_size=8, checkpoints=a[-1])))
    assert gdn_native.VERIFY in ragged.lower(*x, states, meta, ckpt).as_text()
    o, after, kept = ragged(*x, states, meta, ckpt)
    for r in range(2):
        for i in range(D):
            s = states[r]
            for n in range(V):
                t = i * V + n
                o_n, s = decode(*(a[r, t:t + 1] for a in x), jnp.array([i + 1]), jnp.array([True]), s)
                np.testing.assert_array_equal(kept[r, i + 1, n], s[i + 1])
                np.testing.assert_array_equal(o[r, t], o_n[0].astype(o.dtype))
            np.testing.assert_array_equal(after[r, i + 1], s[i + 1])
