"""The model over a ragged batch (the engine's step): flat tokens of many sequences with their caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.config import LINEAR, Config
from qwen35_lib.model.attention import attention_ragged_block
from qwen35_lib.model.decoder import residual_layer
from qwen35_lib.model.deltanet import gdn_ragged_block
from qwen35_lib.model.layer_loop import group_layers, is_per_layer
from qwen35_lib.model.layers import linear, rms_norm
from qwen35_lib.model.moe import stacked_experts, with_experts
from qwen35_lib.model.parallelism import check_parallelism


def ragged_forward(cfg: Config, weights: dict, cache: dict, tokens: jax.Array, meta, parallelism=None
                   ) -> tuple[jax.Array, dict]:
    """float32 logits at each sequence's last new token, and the updated caches.

    tokens: [R, T]; meta: RaggedMeta with leading R; cache: see `qwen35_lib.engine.cache`; `parallelism` as in
    `forward` (static under jit: `jax.jit(ragged_forward, static_argnums=0, static_argnames="parallelism")`).
    Returns (logits [R, S, V], cache). The decoder is a scan over stacked layer groups (the caches ride in the
    carry, each group's slice updated in place), or an unrolled loop when `weights["layers"]` holds per-layer
    leaves (`model.layer_loop`: XLA:CPU; the engine passes `prepare_weights(cfg, weights, plan)`).
    """
    with jax.named_scope("model"):  # the profile's model part (`bench.profile`); the engine samples after it
        return _ragged_forward(cfg, weights, cache, tokens, meta, check_parallelism(cfg, parallelism))


def _ragged_forward(cfg: Config, weights: dict, cache: dict, tokens: jax.Array, meta, parallelism
                    ) -> tuple[jax.Array, dict]:
    h = weights["embed"][tokens]  # [R, T, D]
    valid = meta.token_seq >= 0  # [R, T]: padding tokens are routed to no expert

    def get(cache, name, gi, i):  # layer [gi, i]'s pool: its own buffer (per-layer cache) or a stacked slice
        pool = cache[name]
        return pool[gi][i] if is_per_layer(pool) else pool[gi, i]

    def put(cache, name, gi, i, value):
        pool = cache[name]
        if is_per_layer(pool):
            pool = tuple(tuple(value if (g, j) == (gi, i) else a for j, a in enumerate(row))
                         for g, row in enumerate(pool))
            return dict(cache, **{name: pool})
        return dict(cache, **{name: pool.at[gi, i].set(value)})

    def group(h, cache, layers, gi):
        """Group gi's layers; each reads and writes its own cache entry [gi, i] in place."""
        i_gdn = i_attn = 0
        for kind, lw in zip(cfg.layer_pattern, layers):
            if kind == LINEAR:
                def mixer(w, x, i=i_gdn):
                    nonlocal cache
                    layer = {n: get(cache, n, gi, i) for n in ("conv_q", "conv_k", "conv_v", "state")}
                    x, layer = gdn_ragged_block(cfg, w, x, meta, layer, parallelism)
                    for n in layer:
                        cache = put(cache, n, gi, i, layer[n])
                    return x
                i_gdn += 1
            else:
                def mixer(w, x, i=i_attn):
                    nonlocal cache
                    scales = get(cache, "kv_scale", gi, i) if "kv_scale" in cache else None
                    kv = get(cache, "kv", gi, i)
                    x, kv, scales = attention_ragged_block(cfg, w, x, meta, kv, scales, parallelism)
                    cache = put(cache, "kv", gi, i, kv)
                    if scales is not None:
                        cache = put(cache, "kv_scale", gi, i, scales)
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

        def body(carry, xs):
            w, gi = xs
            return group(*carry, with_experts(group_layers(cfg, w), experts, gi), gi), None

        with jax.named_scope("layer_group"):
            (h, cache), _ = jax.lax.scan(body, (h, cache), (scanned, jnp.arange(cfg.num_groups)))
    h = jnp.take_along_axis(h, meta.sample_tok[..., None], axis=1)  # [R, S, D]
    h = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)
    with jax.named_scope("lm_head"):
        logits = linear(h, weights["lm_head"], dtype=jnp.float32)  # [R, S, V]
    return logits, cache
