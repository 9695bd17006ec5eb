"""Gated DeltaNet (the linear-attention layers): projections, causal conv, the delta rule, gated norm."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.config import Config
from qwen35_lib.kernels import for_plan
from qwen35_lib.model.layers import gated_rms_norm, linear
from qwen35_lib.plan import SINGLE, ServingPlan


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


def conv_groups(plan: ServingPlan) -> tuple[str, ...]:
    """Which of q, k and v run one causal conv together, joined on their last axis (one gather, one tap sum): all
    three, each k head beside the r = Hv / Hk v heads it serves (the checkpoint's one conv1d over q, k, v), unless
    `plan` splits the v heads over devices (tensor parallelism): joined, v heads would move between devices where
    Hk does not split as Hv does (13-25 all-gathers in a qwen3.5-mini step), so q and k (the same heads) together
    and v alone."""
    return ("qkv",) if plan.axes("gdn_v_heads") is None else ("qk", "v")


def _by_k_head(cfg: Config, group: str, n: str, a: jax.Array) -> jax.Array:
    """`a` [..., H, d] of name `n` as it joins `group`: v [..., Hv, dv] -> [..., Hk, r dv] beside q and k."""
    if n != "v" or group == "v":
        return a
    return a.reshape(*a.shape[:-2], cfg.gdn_num_k_heads, cfg.gdn_num_v_heads // cfg.gdn_num_k_heads * a.shape[-1])


def _join(cfg: Config, group: str, arrays: dict) -> jax.Array:
    """`arrays[n]` [..., H_n, d_n] of the names in `group`, joined on the last axis: [..., Hk, sum of widths]."""
    return jnp.concatenate([_by_k_head(cfg, group, n, arrays[n]) for n in group], axis=-1)


def _split(group: str, x: jax.Array, like: dict) -> dict:
    """The inverse of `_join`: the last axis of `x` [..., H, C] cut into `group`'s arrays, shaped as `like`'s."""
    widths = [like[n].shape[-1] * like[n].shape[-2] // x.shape[-2] for n in group]
    parts = jnp.split(x, np.cumsum(widths)[:-1], axis=-1)
    return {n: p.reshape(*p.shape[:-2], *like[n].shape[-2:]) for n, p in zip(group, parts)}


def gdn_block(cfg: Config, w: dict, x: jax.Array, valid: jax.Array, conv_hist: dict | None = None,
              state: jax.Array | None = None, plan: ServingPlan = SINGLE) -> tuple[jax.Array, dict, jax.Array]:
    """One Gated DeltaNet layer over [B, T, D], continuing from (conv_hist, state) when given.

    valid: [B, T] bool, False at right padding: those tokens are zeroed (as HF does) and get g = beta = 0, so
    they leave the state untouched and the returned state is the one after each row's last real token.
    conv_hist: {"q","k","v": [B, K-1, H, d]} previous conv inputs; state: [B, Hv, dk, dv].
    1. q, k, v, z, b, a projections; 2. causal conv + SiLU on q, k, v; 3. beta = sigmoid(b), g = -exp(A_log)
    softplus(a + dt_bias); 4. the delta rule (kernel slot `gdn`, as `plan` names it); 5. gated RMSNorm, out_proj.
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
        inputs, taps = {n: linear(x, w[f"w_{n}"]) for n in "qkv"}, {n: w[f"conv_{n}"] for n in "qkv"}
        conv_out, new_hist = {}, {}
        for group in conv_groups(plan):
            y, hist = causal_conv(_join(cfg, group, inputs), _join(cfg, group, taps), _join(cfg, group, conv_hist))
            conv_out |= _split(group, y, inputs)
            new_hist |= _split(group, hist, conv_hist)
        z = linear(x, w["w_z"])  # [B, T, Hv, dv]
        beta = jax.nn.sigmoid(linear(x, w["w_b"]).astype(jnp.float32))  # [B, T, Hv]
        a = linear(x, w["w_a"]).astype(jnp.float32)
        g = -jnp.exp(w["A_log"]) * jax.nn.softplus(a + w["dt_bias"])  # [B, T, Hv], <= 0
        beta = jnp.where(valid[..., None], beta, 0.0)
        g = jnp.where(valid[..., None], g, 0.0)
        o, state = for_plan("gdn", plan).dense(conv_out["q"], conv_out["k"], conv_out["v"], g, beta, state,
                                               chunk_size=cfg.gdn_chunk_size)
        o = gated_rms_norm(o, z, w["norm"], cfg.rms_norm_eps)  # [B, T, Hv, dv]
        return linear(o, w["w_out"], contract=2), new_hist, state.astype(jnp.dtype(cfg.gdn_state_dtype))


def ragged_conv(x: jax.Array, taps: jax.Array, hists: tuple[jax.Array, ...], meta) -> tuple[jax.Array, tuple]:
    """Causal conv + SiLU over one rank's flat ragged tokens, continuing each sequence from its slot.

    x: [T, H, C]; taps: [K, H, C]; hists: slot pools of previous inputs, [NS, K-1, H_i, d_i] each, as the cache
    holds them (a pool is only gathered from and scattered into, never reshaped: it may hold every layer's slots,
    `model.ragged`); a sequence's rows of pool i, [K-1, H_i, d_i], join x's heads as [K-1, H, H_i d_i / H] (v's
    r = Hv / Hk heads of a k head side by side, `_by_k_head`), and those widths joined are C (the pools of a GDN
    layer's `conv_groups`); meta: RaggedMeta.
    Tap j of token t reads input t - (K-1-j): the flat token itself when it belongs to the same step of the
    same sequence (>= q_start), else the sequence's history (zeros for a sequence's first step). Every input
    is one row of `ext` = [each sequence's history (S * (K-1) rows); x (T rows)], read by a single gather (the
    former gathers per tap and per source, about 20 per projection, traced about a third slower; same outputs).
    Returns (y [T, H, C], each pool with each sequence's last K - 1 inputs stored in its slot).
    """
    K, T, S = taps.shape[0], x.shape[0], meta.q_start.shape[0]
    fresh = meta.kv_len == meta.q_len  # [S]
    H = x.shape[1]
    by_head = lambda rows: rows.reshape(*rows.shape[:-2], H, -1)  # [.., H_i, d_i] -> [.., H, c_i]
    seq_hist = jnp.concatenate([by_head(h[meta.slot]).astype(x.dtype) for h in hists], axis=-1)  # [S, K-1, H, C]
    seq_hist = jnp.where(fresh[:, None, None, None], 0, seq_hist)
    ext = jnp.concatenate([seq_hist.reshape(S * (K - 1), *x.shape[1:]), x])  # [S*(K-1) + T, H, C]

    def source(idx, s):  # row of `ext` holding input number idx (flat index space) of sequence s
        start = meta.q_start[s]
        from_hist = s * (K - 1) + jnp.clip(K - 1 - (start - idx), 0, K - 2)
        return jnp.where(idx >= start, S * (K - 1) + jnp.clip(idx, 0, T - 1), from_hist)

    seq = jnp.clip(meta.token_seq, 0)[:, None]  # [T, 1]
    tap_src = source(jnp.arange(T)[:, None] - (K - 1) + jnp.arange(K)[None, :], seq)  # [T, K]
    s_all = jnp.arange(S)[:, None]
    end = (meta.q_start + meta.q_len)[:, None]  # [S, 1]
    hist_src = source(end - (K - 1) + jnp.arange(K - 1)[None, :], s_all)  # [S, K-1]
    rows = jnp.take(ext, jnp.concatenate([tap_src.ravel(), hist_src.ravel()]), axis=0, mode="clip")
    inputs, new = rows[:T * K].reshape(T, K, *x.shape[1:]), rows[T * K:].reshape(S, K - 1, *x.shape[1:])
    y = sum(inputs[:, j].astype(jnp.float32) * taps[j].astype(jnp.float32) for j in range(K))
    slots = jnp.where(meta.q_len > 0, meta.slot, 0)
    ends = np.cumsum([h.shape[-1] * h.shape[-2] // H for h in hists])[:-1]
    return jax.nn.silu(y).astype(x.dtype), tuple(h.at[slots].set(part.reshape(*part.shape[:2], *h.shape[-2:])
                                                                 .astype(h.dtype))
                                                 for h, part in zip(hists, jnp.split(new, ends, axis=-1)))


def gdn_ragged_block(cfg: Config, w: dict, x: jax.Array, meta, cache: dict, parallelism) -> tuple[jax.Array, dict]:
    """One GDN layer over a ragged batch: x [R, T, D]; meta fields [R, ...]; cache {"conv_q", ..., "state"}
    with [R, NS, ...] pools (NS: this layer's slots, or every layer's, `meta.slot` pointing at this layer's). The same
    math as `gdn_block`, with per-sequence state slots."""
    with jax.named_scope("gdn"):
        valid = meta.token_seq >= 0  # [R, T]
        x = jnp.where(valid[..., None], x, 0).astype(x.dtype)
        inputs, taps = {n: linear(x, w[f"w_{n}"]) for n in "qkv"}, {n: w[f"conv_{n}"] for n in "qkv"}
        pools = {n: cache[f"conv_{n}"] for n in "qkv"}  # [R, NS, K-1, H, d]
        out, new_cache = {}, {}
        for group in conv_groups(parallelism.plan):
            y, new = jax.vmap(ragged_conv, (0, None, 0, 0))(_join(cfg, group, inputs), _join(cfg, group, taps),
                                                             tuple(pools[n] for n in group), meta)
            out |= _split(group, y, inputs)
            new_cache |= {f"conv_{n}": pool for n, pool in zip(group, new)}
        z = linear(x, w["w_z"])
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(linear(x, w["w_b"]).astype(jnp.float32)), 0.0)
        a = linear(x, w["w_a"]).astype(jnp.float32)
        g = jnp.where(valid[..., None], -jnp.exp(w["A_log"]) * jax.nn.softplus(a + w["dt_bias"]), 0.0)
        ragged = partial(for_plan("gdn", parallelism.plan).ragged, chunk_size=cfg.gdn_chunk_size)
        o, new_cache["state"] = parallelism.per_rank(cfg, "gdn", ragged, out["q"], out["k"], out["v"], g, beta,
                                                     cache["state"], meta)
        o = gated_rms_norm(o, z, w["norm"], cfg.rms_norm_eps)
        return linear(o, w["w_out"], contract=2), new_cache
