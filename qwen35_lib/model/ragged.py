"""The model over a ragged batch (the engine's step): flat tokens of many sequences with their caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.config import LINEAR, Config
from qwen35_lib.model.attention import attention_ragged_block
from qwen35_lib.model.decoder import residual_layer
from qwen35_lib.model.deltanet import gdn_ragged_block
from qwen35_lib.model.layer_loop import LayerPools, is_per_layer, layer_groups
from qwen35_lib.model.layers import linear, rms_norm
from qwen35_lib.model.parallelism import check_parallelism


def ragged_forward(cfg: Config, weights: dict, cache: dict, tokens: jax.Array, meta, parallelism=None, *,
                   embedded: jax.Array | None = None, return_hidden: bool = False) -> tuple[jax.Array, ...]:
    """float32 logits at each sequence's last new token, and the updated caches.

    tokens: [R, T]; meta: RaggedMeta with leading R; cache: see `qwen35_lib.engine.cache`; `parallelism` as in
    `forward` (static under jit: `jax.jit(ragged_forward, static_argnums=0, static_argnames="parallelism")`).
    Returns (logits [R, S, V], cache). The decoder is a scan over stacked layer groups (the caches ride in the
    carry, one pool a kind, each layer's pages and slots addressed as rows of it and updated in place: no layer's
    pool is sliced out), or an unrolled loop when `weights["layers"]` holds per-layer leaves (`model.layer_loop`:
    XLA:CPU; the engine passes `prepare_weights(cfg, weights, plan)`).
    With `meta.sample_tok` [R, S, V] (speculative verification, `engine.batch`) the logits are [R, S, V, vocab].
    `embedded` [R, T, D]: the first layer's input instead of the token embeddings (the MTP head's, whose `tokens`
    are then unused); `return_hidden`: also the last hidden states after the final norm at every token, [R, T, D].
    """
    with jax.named_scope("model"):  # the profile's model part (`bench.profile`); the engine samples after it
        return _ragged_forward(cfg, weights, cache, tokens, meta, check_parallelism(cfg, parallelism), embedded,
                               return_hidden)


GDN_POOLS = ("conv_q", "conv_k", "conv_v", "state", "conv_q_ckpt", "conv_k_ckpt", "conv_v_ckpt", "state_ckpt")
ATTN_POOLS = ("kv", "kv_scale")


def _ragged_forward(cfg: Config, weights: dict, cache: dict, tokens: jax.Array, meta, parallelism, embedded=None,
                    return_hidden: bool = False) -> tuple[jax.Array, ...]:
    h = weights["embed"][tokens] if embedded is None else embedded  # [R, T, D]
    valid = meta.token_seq >= 0  # [R, T]: padding tokens are routed to no expert

    def group(carry, layers, gi):
        """Group gi's layers; layer j of a kind (j = gi * n + i) reads and writes its part of the kind's pools."""
        h, pools = carry
        i_gdn = i_attn = 0
        for kind, lw in zip(cfg.layer_pattern, layers):
            if kind == LINEAR:
                def mixer(w, x, j=gi * cfg.gdn_per_group + i_gdn):
                    nonlocal pools
                    x, new = gdn_ragged_block(cfg, w, x, pools.rows(meta, "slot", "state", j),
                                              pools.get(j, GDN_POOLS), parallelism)
                    pools = pools.put(j, new)
                    return x
                i_gdn += 1
            else:
                def mixer(w, x, j=gi * cfg.attn_per_group + i_attn):
                    nonlocal pools
                    own = pools.get(j, ATTN_POOLS)
                    x, kv, scales = attention_ragged_block(cfg, w, x, pools.rows(meta, "page_table", "kv", j),
                                                           own["kv"], own.get("kv_scale"), parallelism)
                    pools = pools.put(j, {"kv": kv} | ({} if scales is None else {"kv_scale": scales}))
                    return x
                i_attn += 1
            h = residual_layer(cfg, parallelism, lw, h, mixer, valid)
        return h, pools

    # the stacked form's pools merged, every layer's update in place; the weights' form picks the loop
    h, pools = layer_groups(cfg, weights["layers"], group, (h, LayerPools.of(cache)), parallelism)
    cache = pools.cache()
    R = h.shape[0]
    if return_hidden:  # every token's, normed (the MTP head's input); the logits' rows taken from them
        hidden = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)  # [R, T, D]
        h = jnp.take_along_axis(hidden, meta.sample_tok.reshape(R, -1)[..., None], axis=1)
    else:
        h = jnp.take_along_axis(h, meta.sample_tok.reshape(R, -1)[..., None], axis=1)  # [R, S, D] ([R, S V, D])
        h = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)
    with jax.named_scope("lm_head"):
        logits = linear(h, weights["lm_head"], dtype=jnp.float32)  # [R, S, V]
    logits = logits.reshape(*meta.sample_tok.shape, logits.shape[-1])
    return (logits, cache, hidden) if return_hidden else (logits, cache)


def keep_accepted(cache: dict, meta, accepted: jax.Array) -> dict:
    """Roll each verified sequence's GDN state back to its accepted position: `accepted` [R, S] tokens of each
    decode row kept (1 + its accepted drafts); its slot's state becomes checkpoint n - 1 and its conv history rows
    [n, n + K - 1) of its window (`deltanet.conv_window`), in every GDN layer, pools of either form
    (`layer_loop`). The KV pages need nothing: the sequence's length decides what is read, and a rejected position
    is written over when it comes again."""
    D = meta.decode_seq.shape[-1]
    slot = jnp.where(meta.decode_seq >= 0, meta.slot[:, :D], 0)  # [R, D]: decode row i is sequence i

    def keep(pool, ckpt, slot, first):  # one rank and layer: pool [NS, ...] <- ckpt [NS, V or K-1+V, ...]
        state = pool.ndim < ckpt.ndim  # the state: one checkpoint; a conv history: K - 1 rows of its window
        at = first[:, None] + jnp.arange(1 if state else pool.shape[1])  # [D, width]
        rows = ckpt[slot[:, None], at]  # [D, width, ...]: the kept rows only, not each slot's whole window
        return pool.at[slot].set(rows[:, 0] if state else rows)

    def keep_layers(pool, ckpt, slot, first):  # one rank: pool [L, NS, ...] <- ckpt [L, NS, ...], layer by layer
        # (every layer at once gathered [L, D, V, ...]: at 397B, c512, k = 1 an 11.8 GiB temporary on TPU7x)
        return jax.lax.fori_loop(0, pool.shape[0], lambda i, p: p.at[i].set(keep(p[i], ckpt[i], slot, first)),
                                 pool)

    out = dict(cache)
    for name in ("conv_q", "conv_k", "conv_v", "state"):
        if f"{name}_ckpt" not in cache:
            continue
        pool, ckpt = cache[name], cache[f"{name}_ckpt"]
        first = accepted[:, :D] - (name == "state")  # [R, D]
        if is_per_layer(pool):
            out[name] = tuple(jax.vmap(keep)(p, c, slot, first) for p, c in zip(pool, ckpt))
        else:  # [R, L, NS, ...]
            out[name] = jax.vmap(keep_layers)(pool, ckpt, slot, first)
    return out
