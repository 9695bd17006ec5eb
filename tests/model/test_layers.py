"""model.layers against NumPy written from their definitions: the zero-centred RMSNorm, the gated GDN norm, partial
NeoX RoPE and the float32-accumulated linear layer."""

import jax.numpy as jnp
import numpy as np

from qwen35_lib.model.layers import gated_rms_norm, linear, rms_norm, rope

RNG = np.random.default_rng(0)


def test_rms_norm_scales_by_one_plus_the_weight():
    x, w = RNG.standard_normal((3, 8)).astype(np.float32), RNG.standard_normal(8).astype(np.float32)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * (1 + w)
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6), want, rtol=1e-5, atol=1e-6)
    assert rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), 1e-6).dtype == jnp.bfloat16


def test_gated_rms_norm_gates_by_silu_of_z():
    o, z = RNG.standard_normal((2, 6)).astype(np.float32), RNG.standard_normal((2, 6)).astype(np.float32)
    w = RNG.standard_normal(6).astype(np.float32)
    silu = z / (1 + np.exp(-z))
    want = w * o / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-6) * silu
    np.testing.assert_allclose(gated_rms_norm(jnp.asarray(o), jnp.asarray(z), jnp.asarray(w), 1e-6), want,
                               rtol=1e-5, atol=1e-6)


def test_rope_rotates_pairs_half_a_rotary_dim_apart_and_passes_the_rest():
    d, rd, theta = 8, 4, 100.0
    x = RNG.standard_normal((1, 3, 2, d)).astype(np.float32)
    pos = np.array([[0, 1, 5]])
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), rd, theta))
    want = x.copy()
    for t in range(3):
        for i in range(rd // 2):  # NeoX: dim i pairs with dim i + rd/2, at angle pos * theta^(-2i/rd)
            a = pos[0, t] * theta ** (-2 * i / rd)
            x1, x2 = x[0, t, :, i], x[0, t, :, i + rd // 2]
            want[0, t, :, i] = x1 * np.cos(a) - x2 * np.sin(a)
            want[0, t, :, i + rd // 2] = x2 * np.cos(a) + x1 * np.sin(a)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0, 0], x[0, 0])  # position 0: no rotation


def test_linear_contracts_the_last_dims():
    x, w = RNG.standard_normal((2, 3, 4)).astype(np.float32), RNG.standard_normal((3, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(linear(jnp.asarray(x), jnp.asarray(w), contract=2), np.einsum("bij,ijk->bk", x, w),
                               rtol=1e-5, atol=1e-5)
    y = linear(jnp.asarray(x[0], jnp.bfloat16), jnp.asarray(w[0], jnp.bfloat16))  # [3, 4] @ [4, 5]
    assert y.dtype == jnp.bfloat16 and y.shape == (3, 5)
    np.testing.assert_allclose(np.asarray(y, np.float32), x[0] @ w[0], rtol=2e-2, atol=5e-2)
