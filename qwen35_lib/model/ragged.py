"""The model over a ragged batch (the engine's step): flat tokens of many sequences with their caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.config import LINEAR, Config
from qwen35_lib.model.attention import attention_ragged_block
from qwen35_lib.model.decoder import residual_layer
from qwen35_lib.model.deltanet import gdn_ragged_block
from qwen35_lib.model.layer_loop import group_layers, is_per_layer, stacked_dense, with_dense
from qwen35_lib.model.layers import linear, rms_norm
from qwen35_lib.model.moe import stacked_experts, with_experts
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


def merged_pools(cache: dict) -> tuple[dict, dict]:
    """Each pool [R, L, X, ...] of `cache` as one array [R, L*X, ...] (a bitcast), and {name: X}: layer j's page or
    slot x is row j*X + x of its kind's pool (`layer_rows`). Per-layer pools (a tuple: `layer_loop.per_layer_cache`)
    pass as they are."""
    merged, rows = {}, {}
    for name, pool in cache.items():
        if is_per_layer(pool):
            merged[name] = pool
        else:
            R, L, X = pool.shape[:3]
            merged[name], rows[name] = pool.reshape(R, L * X, *pool.shape[3:]), X
    return merged, rows


def layer_rows(meta, field: str, j, rows: int | None):
    """`meta` with its page table (field "page_table") or slots ("slot") moved to layer j's rows of a merged pool
    (`merged_pools`: rows a layer); as it is for a per-layer pool (rows None)."""
    if rows is None:
        return meta
    return meta._replace(**{field: getattr(meta, field) + j * rows})


def _ragged_forward(cfg: Config, weights: dict, cache: dict, tokens: jax.Array, meta, parallelism, embedded=None,
                    return_hidden: bool = False) -> tuple[jax.Array, ...]:
    h = weights["embed"][tokens] if embedded is None else embedded  # [R, T, D]
    valid = meta.token_seq >= 0  # [R, T]: padding tokens are routed to no expert
    shapes = {name: pool.shape for name, pool in cache.items() if not is_per_layer(pool)}
    cache, rows = merged_pools(cache)  # {name: [R, L*X, ...]}: every layer's update lands in place

    def layer(cache, names, j):  # layer j's pools: its own buffer (per-layer) or the whole merged pool of its kind
        return {n: cache[n][j] if is_per_layer(cache[n]) else cache[n] for n in names if n in cache}

    def put(cache, j, new):
        out = dict(cache)
        for n, value in new.items():
            pool = cache[n]
            out[n] = tuple(value if k == j else a for k, a in enumerate(pool)) if is_per_layer(pool) else value
        return out

    def group(h, cache, layers, gi):
        """Group gi's layers; layer j of a kind (j = gi * n + i) reads and writes its rows of the kind's pools."""
        i_gdn = i_attn = 0
        for kind, lw in zip(cfg.layer_pattern, layers):
            if kind == LINEAR:
                def mixer(w, x, j=gi * cfg.gdn_per_group + i_gdn):
                    nonlocal cache
                    m = layer_rows(meta, "slot", j, rows.get("state"))
                    x, new = gdn_ragged_block(cfg, w, x, m, layer(cache, GDN_POOLS, j), parallelism)
                    cache = put(cache, j, new)
                    return x
                i_gdn += 1
            else:
                def mixer(w, x, j=gi * cfg.attn_per_group + i_attn):
                    nonlocal cache
                    m = layer_rows(meta, "page_table", j, rows.get("kv"))
                    pools = layer(cache, ATTN_POOLS, j)
                    x, kv, scales = attention_ragged_block(cfg, w, x, m, pools["kv"], pools.get("kv_scale"),
                                                           parallelism)
                    cache = put(cache, j, {"kv": kv} | ({} if scales is None else {"kv_scale": scales}))
                    return x
                i_attn += 1
            h = residual_layer(cfg, parallelism, lw, h, mixer, valid)
        return h, cache

    if is_per_layer(weights["layers"]):  # unrolled over per-layer leaves (`model.layer_loop`)
        for gi, layers in enumerate(weights["layers"]):
            with jax.named_scope(f"layer_group_{gi}"):
                h, cache = group(h, cache, layers, gi)
    else:
        # experts read in place (the plan's MoE kernel reads stacks): not scanned
        scanned, experts = stacked_experts(cfg, weights["layers"], parallelism.plan)
        scanned, dense = stacked_dense(cfg, scanned, parallelism.plan)  # and the projections, where read in place

        def body(carry, xs):
            w, gi = xs
            layers = with_dense(cfg, with_experts(group_layers(cfg, w), experts, gi), dense, gi, parallelism)
            return group(*carry, layers, gi), None

        with jax.named_scope("layer_group"):
            (h, cache), _ = jax.lax.scan(body, (h, cache), (scanned, jnp.arange(cfg.num_groups)))
    cache = {name: pool.reshape(shapes[name]) if name in shapes else pool for name, pool in cache.items()}
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
