"""The XLA kernels against their twins: chunked vs recurrent GDN, grouped MoE vs dense, permute round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.kernels import gdn_xla

# jitted once per shape: eager op-by-op dispatch would dominate the test time
gdn_recurrent = jax.jit(gdn_xla.gdn_recurrent)
gdn_chunked = jax.jit(gdn_xla.gdn_chunked, static_argnames="chunk_size")


def _gdn_inputs(key, B, T, Hk, Hv, dk, dv):
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, Hk, dk))
    k = jax.random.normal(ks[1], (B, T, Hk, dk))
    v = jax.random.normal(ks[2], (B, T, Hv, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, Hv)))  # log decay <= 0
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, Hv)))
    state = 0.1 * jax.random.normal(ks[5], (B, Hv, dk, dv))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 64, 150])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])  # (key heads, value heads): GVA when they differ
def test_gdn_chunked_matches_recurrent(T, heads):
    # float32 end to end; the two forms reorder sums over up to T tokens, so 1e-5 relative to O(1) values.
    inputs = _gdn_inputs(jax.random.key(T), 2, T, *heads, 16, 24)
    o_r, s_r = gdn_recurrent(*inputs)
    o_c, s_c = gdn_chunked(*inputs, chunk_size=64)
    np.testing.assert_allclose(o_c, o_r, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s_c, s_r, atol=1e-5, rtol=1e-5)


def test_gdn_chunked_continues_from_state():
    # Splitting a sequence at a non-chunk boundary and carrying the state gives the same outputs.
    q, k, v, g, beta, s0 = _gdn_inputs(jax.random.key(1), 1, 100, 2, 4, 16, 24)
    o_full, s_full = gdn_chunked(q, k, v, g, beta, s0)
    cut = 37
    o1, s1 = gdn_chunked(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], s0)
    o2, s2 = gdn_chunked(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), o_full, atol=1e-5)
    np.testing.assert_allclose(s2, s_full, atol=1e-5)
