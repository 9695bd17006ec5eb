"""Gated GQA attention (the full-attention layers)."""

from __future__ import annotations

import jax

from qwen35_lib.config import Config
from qwen35_lib.kernels import for_config
from qwen35_lib.model.layers import linear, rms_norm, rope


def qkv(cfg: Config, w: dict, x: jax.Array, positions: jax.Array):
    """Projections, per-head zero-centred q/k norms and partial RoPE.

    x: [B, T, D] -> q, gate [B, T, Hq, d]; k, v [B, T, Hkv, d] (k as the KV cache stores it: normed, rotated).
    """
    q = rms_norm(linear(x, w["w_q"]), w["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(linear(x, w["w_k"]), w["k_norm"], cfg.rms_norm_eps)
    q = rope(q, positions, cfg.rotary_dim, cfg.rope_theta)
    k = rope(k, positions, cfg.rotary_dim, cfg.rope_theta)
    return q, linear(x, w["w_gate"]), k, linear(x, w["w_v"])


def output(w: dict, o: jax.Array, gate: jax.Array) -> jax.Array:
    """o * sigmoid(gate), then the output projection: [B, T, Hq, d] -> [B, T, D]."""
    return linear(o * jax.nn.sigmoid(gate), w["w_o"], contract=2)


def attention_block(cfg: Config, w: dict, x: jax.Array, positions: jax.Array, lengths: jax.Array) -> jax.Array:
    """Full-sequence gated attention over right-padded rows. x: [B, T, D] -> [B, T, D]."""
    with jax.named_scope("attention"):
        q, gate, k, v = qkv(cfg, w, x, positions)
        o = for_config("attention", cfg)(q, k, v, lengths)  # [B, T, Hq, d]
        return output(w, o, gate)
