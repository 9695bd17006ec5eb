"""Gated DeltaNet (the linear-attention layers): projections, causal conv, the delta rule, gated norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.config import Config
from qwen35_lib.kernels import for_config
from qwen35_lib.model.layers import gated_rms_norm, linear


def causal_conv(x: jax.Array, taps: jax.Array, history: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d + SiLU, continuing from the previous K - 1 inputs.

    x: [B, T, H, d]; taps: [K, H, d] (taps[K-1] multiplies the current token); history: [B, K-1, H, d].
    Returns (silu(conv) [B, T, H, d] in x's dtype, the new history: the last K - 1 inputs).
    """
    K = taps.shape[0]
    xp = jnp.concatenate([history.astype(x.dtype), x], axis=1)  # [B, K-1+T, H, d]
    T = x.shape[1]
    y = sum(xp[:, j : j + T].astype(jnp.float32) * taps[j].astype(jnp.float32) for j in range(K))
    return jax.nn.silu(y).astype(x.dtype), xp[:, T:]


def gdn_block(cfg: Config, w: dict, x: jax.Array, valid: jax.Array, conv_hist: dict | None = None,
              state: jax.Array | None = None) -> tuple[jax.Array, dict, jax.Array]:
    """One Gated DeltaNet layer over [B, T, D], continuing from (conv_hist, state) when given.

    valid: [B, T] bool, False at right padding: those tokens are zeroed (as HF does) and get g = beta = 0, so
    they leave the state untouched and the returned state is the one after each row's last real token.
    conv_hist: {"q","k","v": [B, K-1, H, d]} previous conv inputs; state: [B, Hv, dk, dv].
    1. q, k, v, z, b, a projections; 2. causal conv + SiLU on q, k, v; 3. beta = sigmoid(b),
    g = -exp(A_log) softplus(a + dt_bias); 4. the delta rule (kernel slot `gdn`); 5. gated RMSNorm, out_proj.
    Note: the conv history is taken at the end of the block (T tokens), so callers that continue a padded row
    must pass the history at its real end (the engine does).
    """
    B, T, _ = x.shape
    with jax.named_scope("gdn"):
        x = jnp.where(valid[..., None], x, 0).astype(x.dtype)
        if conv_hist is None:
            K = cfg.gdn_conv_kernel
            conv_hist = {n: jnp.zeros((B, K - 1, *w[f"conv_{n}"].shape[1:]), x.dtype) for n in "qkv"}
        if state is None:
            state = jnp.zeros((B, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim), jnp.float32)
        conv_out, new_hist = {}, {}
        for n in "qkv":
            conv_out[n], new_hist[n] = causal_conv(linear(x, w[f"w_{n}"]), w[f"conv_{n}"], conv_hist[n])
        z = linear(x, w["w_z"])  # [B, T, Hv, dv]
        beta = jax.nn.sigmoid(linear(x, w["w_b"]).astype(jnp.float32))  # [B, T, Hv]
        a = linear(x, w["w_a"]).astype(jnp.float32)
        g = -jnp.exp(w["A_log"]) * jax.nn.softplus(a + w["dt_bias"])  # [B, T, Hv], <= 0
        beta = jnp.where(valid[..., None], beta, 0.0)
        g = jnp.where(valid[..., None], g, 0.0)
        o, state = for_config("gdn", cfg)(conv_out["q"], conv_out["k"], conv_out["v"], g, beta, state,
                                          chunk_size=cfg.gdn_chunk_size)
        o = gated_rms_norm(o, z, w["norm"], cfg.rms_norm_eps)  # [B, T, Hv, dv]
        return linear(o, w["w_out"], contract=2), new_hist, state.astype(jnp.dtype(cfg.gdn_state_dtype))
