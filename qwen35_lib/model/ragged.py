"""The model over a ragged batch (the engine's step): flat tokens of many sequences with their caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.config import LINEAR, Config
from qwen35_lib.model.attention import attention_ragged_block
from qwen35_lib.model.decoder import _take, residual_layer
from qwen35_lib.model.deltanet import gdn_ragged_block
from qwen35_lib.model.layers import rms_norm
from qwen35_lib.model.parallelism import check_parallelism


def ragged_forward(cfg: Config, weights: dict, cache: dict, tokens: jax.Array, meta, parallelism=None
                   ) -> tuple[jax.Array, dict]:
    """float32 logits at each sequence's last new token, and the updated caches.

    tokens: [R, T]; meta: RaggedMeta with leading R; cache: see `qwen35_lib.engine.cache`; `parallelism` as in
    `forward` (static under jit: `jax.jit(ragged_forward, static_argnums=0, static_argnames="parallelism")`).
    Returns (logits [R, S, V], cache). The decoder is a scan over layer groups; the caches ride in the carry
    and each group's slice is updated in place (no second copy of the cache).
    """
    parallelism = check_parallelism(cfg, parallelism)
    h = weights["embed"][tokens]  # [R, T, D]

    def body(carry, xs):
        h, cache = carry
        w, gi = xs
        c = jax.tree.map(lambda a: a[gi], cache)  # this group's caches: [n, R, ...]
        i_gdn = i_attn = 0
        for p, kind in enumerate(cfg.layer_pattern):
            if kind == LINEAR:
                def mixer(x, i=i_gdn):
                    nonlocal c
                    layer = {n: c[n][i] for n in ("conv_q", "conv_k", "conv_v", "state")}
                    x, layer = gdn_ragged_block(cfg, _take(w["gdn"], i), x, meta, layer, parallelism)
                    c = dict(c, **{n: c[n].at[i].set(layer[n]) for n in layer})
                    return x
                i_gdn += 1
            else:
                def mixer(x, i=i_attn):
                    nonlocal c
                    scales = c["kv_scale"][i] if "kv_scale" in c else None
                    x, kv, scales = attention_ragged_block(cfg, _take(w["attn"], i), x, meta, c["kv"][i], scales,
                                                           parallelism)
                    c = dict(c, kv=c["kv"].at[i].set(kv))
                    if scales is not None:
                        c["kv_scale"] = c["kv_scale"].at[i].set(scales)
                    return x
                i_attn += 1
            h = residual_layer(cfg, parallelism, w, p, h, mixer)
        cache = jax.tree.map(lambda a, n: a.at[gi].set(n), cache, c)
        return (h, cache), None

    with jax.named_scope("layer_group"):
        (h, cache), _ = jax.lax.scan(body, (h, cache), (weights["layers"], jnp.arange(cfg.num_groups)))
    h = jnp.take_along_axis(h, meta.sample_tok[..., None], axis=1)  # [R, S, D]
    h = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("rsd,dv->rsv", h, weights["lm_head"], preferred_element_type=jnp.float32)
    return logits, cache
