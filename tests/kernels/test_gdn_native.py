"""kernels.gdn_native: the C++ GDN decode step against per-row float64 math (continuing, fresh and padding rows,
untouched slots, float32 and bfloat16 inputs); the ragged protocol against the XLA twin on a mixed batch of two
ranks; where it cannot run (a bfloat16 state pool) the XLA form runs; the engine's CPU default runs the handler.

Tolerances: float32 against float64 the rounding of a 64-term sum (1e-5 on O(1) values); the mixed batch as in
test_gdn_pallas (the same maths in another order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.bench.kernels_gdn import random_gdn_inputs
from qwen35_lib.kernels import gdn_native, gdn_xla, get, native
from tests.kernels.test_gdn_pallas import HEADS, RANKS, _meta, _state

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_matches_xla(dtype):
    """The `native` ragged kernel (its decode region the handler, its prefill region XLA's) against `xla` on two
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
    states = _state(jax.random.key(7), (5,), **HEADS, dtype=jnp.bfloat16)
    slot, start = jnp.array([1, 2, 3, 4], jnp.int32), jnp.array([True, True, False, True])
    assert gdn_native.native_target(q, v, states) is None
    lowered = jax.jit(gdn_native.gdn_decode_native).lower(q, k, v, g, beta, slot, start, states)
    assert gdn_native.HANDLER not in lowered.as_text()
    o, s = decode(q, k, v, g, beta, slot, start, states)
    o_x, s_x = jax.jit(gdn_xla.gdn_decode_xla)(q, k, v, g, beta, slot, start, states)
    np.testing.assert_array_equal(o, o_x)
    np.testing.assert_array_equal(s, s_x)


def test_the_cpu_default_is_native():
    from qwen35_lib.kernels import for_plan
    from qwen35_lib.plan import SINGLE

    assert for_plan("gdn", SINGLE.bound(None)).ragged.keywords["decode"] is gdn_native.gdn_decode_native


def test_a_step_xla_partitions_runs_the_xla_form():
    """Under a multi-device mesh (a layout's step, partitioned by XLA) the handler would have its operands gathered
    onto every device: the XLA form runs there instead."""
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(8), (4,), **HEADS)
    states = _state(jax.random.key(9), (5,), **HEADS)
    slot, start = jnp.array([1, 2, 3, 4], jnp.int32), jnp.array([True, True, False, True])
    args = (q, k, v, g, beta, slot, start, states)
    assert gdn_native.HANDLER in decode.lower(*args).as_text()
    with jax.set_mesh(jax.make_mesh((len(jax.devices()),), ("x",))):
        assert gdn_native.HANDLER not in jax.jit(gdn_native.gdn_decode_native).lower(*args).as_text()
