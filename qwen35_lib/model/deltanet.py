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


def ragged_conv(x: jax.Array, taps: jax.Array, hist: jax.Array, meta) -> tuple[jax.Array, jax.Array]:
    """Causal conv + SiLU over one rank's flat ragged tokens, continuing each sequence from its slot.

    x: [T, H, d]; taps: [K, H, d]; hist: the slot pool of previous inputs, [NS, K-1, H, d], as the cache holds it (only
    gathered from and scattered into, never reshaped: it may hold every layer's slots, `model.ragged`); meta:
    RaggedMeta. Returns (y [T, H, d] in x's dtype, the pool with each sequence's last K - 1 inputs in its slot; a
    sequence with no tokens here writes the null slot 0). A decode-only step (every token sequence i's one, `pack`)
    reads each sequence's history rows and writes them back shifted (`_decode_conv`); any other step takes
    `_ragged_conv`. Each output sums its taps in order, so it does not depend on how a step split its sequence.
    """
    if x.shape[0] == meta.decode_seq.shape[0] <= meta.q_start.shape[0]:
        return _decode_conv(x, taps, hist, meta)
    return _ragged_conv(x, taps, hist, meta)


def _tap_sum(inputs: list[jax.Array], taps: jax.Array, dtype) -> jax.Array:
    """silu(sum over j of inputs[j] * taps[j]), in float32 and in order, as `dtype`."""
    return jax.nn.silu(sum(a.astype(jnp.float32) * taps[j].astype(jnp.float32) for j, a in enumerate(inputs))
                       ).astype(dtype)


def _decode_conv(x: jax.Array, taps: jax.Array, hist: jax.Array, meta) -> tuple[jax.Array, jax.Array]:
    """`ragged_conv` of a decode-only step: token i is sequence i's new input (x [D, H, d], padding where
    decode_seq is -1): its history's K - 1 rows and itself through the taps, then the history shifted by one row."""
    D = x.shape[0]
    slot = jnp.where(meta.decode_seq >= 0, meta.slot[:D], 0)  # [D]
    fresh = (meta.kv_len[:D] == meta.q_len[:D])[:, None, None, None]
    prev = jnp.where(fresh, 0, hist[slot]).astype(x.dtype)  # [D, K-1, H, d]
    y = _tap_sum([*(prev[:, j] for j in range(prev.shape[1])), x], taps, x.dtype)
    return y, hist.at[slot].set(jnp.concatenate([prev[:, 1:], x[:, None]], 1).astype(hist.dtype))


def _ragged_conv(x: jax.Array, taps: jax.Array, hist: jax.Array, meta) -> tuple[jax.Array, jax.Array]:
    """`ragged_conv` of any step. Tap j of a token reads the input K-1-j rows up in its sequence: from the step's own
    tokens (x shifted: one elementwise pass over x) for every token past the first K - 1 of its sequence's step;
    those first ones read the history too, so they are computed apart over [history; first K - 1 tokens] of each
    sequence ([S, 2K-2] rows) and written over their rows."""
    K, T = taps.shape[0], x.shape[0]
    conv = lambda inputs: _tap_sum(inputs, taps, x.dtype)
    place = jnp.arange(T) - meta.q_start[jnp.clip(meta.token_seq, 0)]  # [T] each token's place in its step
    xp = jnp.pad(x, ((K - 1, 0), (0, 0), (0, 0)))  # [K-1+T, H, d]: row t + j is the input tap j of token t reads
    y = conv([jnp.where((place >= K - 1 - j)[:, None, None], xp[j:j + T], 0) for j in range(K)])  # [T, H, d]
    fresh = (meta.kv_len == meta.q_len)[:, None, None, None]  # a sequence's first step: no history
    first = meta.q_start[:, None] + jnp.arange(K - 1)  # [S, K-1] rows of each step's first K - 1 tokens
    win = jnp.concatenate([jnp.where(fresh, 0, hist[meta.slot]).astype(x.dtype), x[jnp.clip(first, 0, T - 1)]], 1)
    heads = conv([win[:, j:j + K - 1] for j in range(K)])  # [S, K-1, H, d]: the first tokens' outputs
    y = y.at[jnp.where(jnp.arange(K - 1) < meta.q_len[:, None], first, T)].set(heads, mode="drop")
    last = (meta.q_start + meta.q_len)[:, None] - (K - 1) + jnp.arange(K - 1)  # [S, K-1] rows of the last inputs
    short = jnp.clip(meta.q_len[:, None] + jnp.arange(K - 1), 0, 2 * K - 3)[..., None, None]  # in `win` instead
    new = jnp.where((last >= meta.q_start[:, None])[..., None, None], x[jnp.clip(last, 0, T - 1)],
                    jnp.take_along_axis(win, short, axis=1))
    slots = jnp.where(meta.q_len > 0, meta.slot, 0)
    return y, hist.at[slots].set(new.astype(hist.dtype))


def conv_window(x: jax.Array, hist: jax.Array, windows: jax.Array, meta) -> jax.Array:
    """Speculative verification's conv checkpoints: each decode row's history followed by its V inputs, written to
    its slot's window (`windows` [NS, K-1+V, H, d]; x [T, H, d] with row i's tokens at [i V, i V + V), padding zero;
    hist [NS, K-1, H, d] before this step). After n of the row's tokens are accepted its history is rows
    [n, n + K - 1) of the window (`model.ragged.keep_accepted`)."""
    D, V = meta.decode_seq.shape[0], windows.shape[1] - hist.shape[1]
    row = jnp.where(meta.decode_seq >= 0, meta.slot[:D], 0)  # [D]: row i is sequence i
    fresh = (meta.kv_len[:D] == meta.q_len[:D])[:, None, None, None]
    prev = jnp.where(fresh, 0, hist[row]).astype(windows.dtype)  # [D, K-1, H, d]
    return windows.at[row].set(jnp.concatenate([prev, x[:D * V].reshape(D, V, *x.shape[1:]).astype(windows.dtype)],
                                               1))


def gdn_ragged_block(cfg: Config, w: dict, x: jax.Array, meta, cache: dict, parallelism) -> tuple[jax.Array, dict]:
    """One GDN layer over a ragged batch: x [R, T, D]; meta fields [R, ...]; cache {"conv_q", ..., "state"}
    with [R, NS, ...] pools (NS: this layer's slots, or every layer's, `meta.slot` pointing at this layer's). The same
    math as `gdn_block`, with per-sequence state slots. With checkpoint pools in `cache` ("state_ckpt", "conv_*_ckpt":
    speculative verification, `engine.cache`) each decode row's state after each of its tokens and its conv window
    are kept there too."""
    with jax.named_scope("gdn"):
        valid = meta.token_seq >= 0  # [R, T]
        x = jnp.where(valid[..., None], x, 0).astype(x.dtype)
        inputs, taps = {n: linear(x, w[f"w_{n}"]) for n in "qkv"}, {n: w[f"conv_{n}"] for n in "qkv"}
        out, new_cache = {}, {}
        verify = "state_ckpt" in cache  # speculative verification: keep what a rollback needs (`conv_window`)
        for n in "qkv":  # each its own conv: x's taps are shifted views, nothing to gain by joining them
            if verify:
                new_cache[f"conv_{n}_ckpt"] = jax.vmap(conv_window)(inputs[n], cache[f"conv_{n}"],
                                                                    cache[f"conv_{n}_ckpt"], meta)
            out[n], new_cache[f"conv_{n}"] = jax.vmap(ragged_conv, (0, None, 0, 0))(inputs[n], taps[n],
                                                                                     cache[f"conv_{n}"], meta)
        z = linear(x, w["w_z"])
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(linear(x, w["w_b"]).astype(jnp.float32)), 0.0)
        a = linear(x, w["w_a"]).astype(jnp.float32)
        g = jnp.where(valid[..., None], -jnp.exp(w["A_log"]) * jax.nn.softplus(a + w["dt_bias"]), 0.0)
        ragged = partial(for_plan("gdn", parallelism.plan).ragged, chunk_size=cfg.gdn_chunk_size)
        args = (out["q"], out["k"], out["v"], g, beta, cache["state"], meta)
        if verify:  # the state after each of a decode row's V tokens, in its slot's checkpoints
            run = lambda *a: ragged(*a[:-1], checkpoints=a[-1])
            o, new_cache["state"], new_cache["state_ckpt"] = parallelism.per_rank(cfg, "gdn", run, *args,
                                                                                  cache["state_ckpt"])
        else:
            o, new_cache["state"] = parallelism.per_rank(cfg, "gdn", ragged, *args)
        o = gated_rms_norm(o, z, w["norm"], cfg.rms_norm_eps)
        return linear(o, w["w_out"], contract=2), new_cache
