"""qwen35_lib.weights: block FP8 quantization round-trips within e4m3's rounding."""

import jax
import jax.numpy as jnp

from qwen35_lib.weights import BlockFP8, dequantize_fp8, quantize_fp8


def test_fp8_quantize_roundtrip_error_is_e4m3_sized():
    w = jax.random.normal(jax.random.key(0), (3, 40, 2, 24))  # partial blocks on both blocked dims
    q = quantize_fp8(w, 16, (1, 3))
    assert isinstance(q, BlockFP8) and q.value.dtype == jnp.float8_e4m3fn and q.scale.shape == (3, 3, 2, 2)
    err = jnp.abs(dequantize_fp8(q, 16, jnp.float32) - w) / (jnp.abs(w) + 1e-3)
    assert float(jnp.median(err)) < 2**-4  # e4m3 keeps 3 mantissa bits: relative step 2^-3, rounding half that
