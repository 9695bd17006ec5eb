"""Gated GQA attention (the full-attention layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.config import Config
from qwen35_lib.kernels import for_plan
from qwen35_lib.model.layers import linear, rms_norm, rope
from qwen35_lib.plan import SINGLE, ServingPlan


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


def attention_block(cfg: Config, w: dict, x: jax.Array, positions: jax.Array, lengths: jax.Array,
                    plan: ServingPlan = SINGLE) -> jax.Array:
    """Full-sequence gated attention over right-padded rows (the kernel `plan` names). x: [B, T, D] -> [B, T, D]."""
    with jax.named_scope("attention"):
        q, gate, k, v = qkv(cfg, w, x, positions)
        o = for_plan("attention", plan).dense(q, k, v, lengths)  # [B, T, Hq, d]
        return output(w, o, gate)


def attention_ragged_block(cfg: Config, w: dict, x: jax.Array, meta, kv: jax.Array, kv_scales: jax.Array | None,
                           parallelism):
    """Gated attention over a ragged batch and the paged KV cache: x [R, T, D]; kv [R, P, ps, 2*Hkv*d]
    (+ kv_scales [R, P, 2*Hkv, ps] for an FP8 cache). Returns (out [R, T, D], kv, kv_scales).

    1. projections, norms, RoPE at each token's position; 2. write the new K/V into their pages (padding
    tokens into the null page 0); 3. paged attention of every token over its sequence (kernel slot `attention`;
    2 and 3 as one call when the implementation has `paged_write`).
    """
    with jax.named_scope("attention"):
        q, gate, k, v = qkv(cfg, w, x, meta.positions)
        kernels = for_plan("attention", parallelism.plan)
        ps = kv.shape[2]
        valid = meta.token_seq >= 0  # [R, T]
        seq_pages = jnp.take_along_axis(meta.page_table, jnp.clip(meta.token_seq, 0)[..., None], axis=1)  # [R,T,n]
        page = jnp.take_along_axis(seq_pages, (meta.positions // ps)[..., None], axis=2)[..., 0]
        page = jnp.where(valid, page, 0)
        offset = jnp.where(valid, meta.positions % ps, 0)
        ragged = (meta.page_table, meta.token_seq, meta.positions)
        if kernels.paged_write is not None:  # one call: the write, then the attention over the written pages
            o, kv, kv_scales = parallelism.per_rank(cfg, "attention", kernels.paged_write, q, k, v, kv, kv_scales,
                                                    page, offset, *ragged)
        else:
            kv, kv_scales = parallelism.per_rank(cfg, "attention", kernels.write, kv, kv_scales, k, v, page, offset)
            o = parallelism.per_rank(cfg, "attention", kernels.paged, q, kv, kv_scales, *ragged)
        return output(w, o, gate), kv, kv_scales
