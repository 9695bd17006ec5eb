"""The XLA kernels against their twins: chunked vs recurrent GDN, grouped MoE vs dense, permute round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.kernels.gdn import xla as gdn_xla

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


def _verify_meta(rows, V, prefill=0, chunk=8):
    """A ragged step of `rows` decode rows of V tokens (row i of sequence i, slot i + 1, continuing a context) and
    one prefill sequence of `prefill` tokens."""
    from qwen35_lib.engine.batch import SeqWork, pack

    dec = [SeqWork([1] * V, 5, [1], i + 1) for i in range(rows)]
    pre = [SeqWork([1] * prefill, 0, [2], rows + 1)] if prefill else []
    T = rows * V + -(-prefill // chunk) * chunk
    return pack(dec, pre, rows, T, rows + 1, 4, chunk, width=V)[1]


@pytest.mark.parametrize("prefill", [0, 12])
def test_verify_checkpoints_are_the_states_of_the_accepted_tokens_run_alone(prefill):
    """Speculative verification (V tokens a decode row): the state kept after each position is, bitwise in float32,
    the state of decoding that row's first n tokens one step at a time (`gdn_decode_xla`, the k = 0 path); the last
    goes to the slot, and the prefill region is the k = 0 path's."""
    D, V, Hk, Hv, dk, dv = 3, 4, 2, 4, 16, 24
    meta = jax.tree.map(jnp.asarray, _verify_meta(D, V, prefill))
    T = meta.token_seq.shape[0]
    q, k, v, g, beta, _ = _gdn_inputs(jax.random.key(7), 1, T, Hk, Hv, dk, dv)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))
    states = 0.1 * jax.random.normal(jax.random.key(8), (D + 2, Hv, dk, dv))
    ckpt = jnp.zeros((D + 2, V, Hv, dk, dv))
    ragged = jax.jit(gdn_xla.gdn_ragged_xla, static_argnames="chunk_size")
    o, after, kept = ragged(q, k, v, g, beta, states, meta, chunk_size=8, checkpoints=ckpt)
    decode = jax.jit(gdn_xla.gdn_decode_xla)
    for i in range(D):
        s = states
        for n in range(V):
            t = i * V + n
            o_n, s = decode(*(x[t:t + 1] for x in (q, k, v, g, beta)), jnp.array([i + 1]), jnp.array([True]), s)
            np.testing.assert_array_equal(kept[i + 1, n], s[i + 1])
            np.testing.assert_allclose(o[t], o_n[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(after[i + 1], s[i + 1])
    if prefill:
        want_o, want = ragged(*(x[D * V:] for x in (q, k, v, g, beta)), states,
                              jax.tree.map(jnp.asarray, _verify_meta(0, 1, prefill)), chunk_size=8)
        np.testing.assert_allclose(o[D * V:D * V + prefill], want_o[:prefill], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(after[D + 1], want[1], rtol=1e-6, atol=1e-6)  # its slot there: 1
