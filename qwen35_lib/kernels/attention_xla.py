"""Causal GQA attention in plain XLA: the reference twin of the `attention` slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.registry import register


@register("attention", "xla")
def attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """Causal attention over right-padded rows.

    q: [B, T, Hq, d]; k, v: [B, T, Hkv, d] (after norms and RoPE); lengths: [B] real tokens per row.
    Query head h uses KV head h // (Hq // Hkv). Returns o: [B, T, Hq, d] in q's dtype.
    1. scores = q kᵀ / sqrt(d), one KV head's whole query group at once   # [B, Hkv, G, T, T]
    2. mask keys that are in the future or beyond the row's length
    3. softmax in float32, then p v.
    """
    B, T, Hq, d = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, d)  # [B, T, Hkv, G, d]
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    t = jnp.arange(T)
    valid = (t[None, :] <= t[:, None])[None] & (t < lengths[:, None])[:, None, :]  # [B, T, S]
    s = jnp.where(valid[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, Hq, d).astype(q.dtype)
