"""Small building blocks: the two RMSNorms, partial RoPE, and linear layers over declared weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.kernels import dense


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """GDN output norm: (w * o / rms(o)) * silu(z). The weight is plain (1 at init), the norm before the gate."""
    o32 = o.astype(jnp.float32)
    n = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)).astype(o.dtype)
    return ((w * n).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def rope(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Partial NeoX RoPE on the first `rotary_dim` dims of each head; the rest pass through.

    x: [B, T, H, d]; positions: [B, T]. Text-only M-RoPE (same position on all 3 axes) is exactly this.
    """
    inv_freq = theta ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)  # [rd/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rd/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, axis=-1)[:, :, None, :]  # [B, T, 1, rd]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, axis=-1)[:, :, None, :]
    r = x[..., :rotary_dim].astype(jnp.float32)
    r1, r2 = r[..., : rotary_dim // 2], r[..., rotary_dim // 2 :]
    rotated = r * cos + jnp.concatenate([-r2, r1], axis=-1) * sin
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)


def linear(x: jax.Array, w, contract: int = 1, dtype=None) -> jax.Array:
    """x [..., in...] @ w [in..., out...] over the last `contract` dims of x, accumulated in float32, returned in
    `dtype` (default: x's), for w in any form the layers hold it (an array, a stack's layer the plan's `dense` kernel
    reads in place, a weight the CPU engine packed: `kernels.dense.linear`)."""
    with jax.named_scope("proj"):  # the profile's "dense matmuls" (`bench.profile`)
        return dense.linear(x, w, contract, dtype)
