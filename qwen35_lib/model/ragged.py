"""The model over a ragged batch (the engine's step): flat tokens of many sequences with their caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.config import LINEAR, Config
from qwen35_lib.model.attention import attention_ragged_block
from qwen35_lib.model.decoder import _take
from qwen35_lib.model.deltanet import gdn_ragged_block
from qwen35_lib.model.layers import rms_norm
from qwen35_lib.model.moe import moe_block


def ragged_forward(cfg: Config, weights: dict, cache: dict, tokens: jax.Array, meta) -> tuple[jax.Array, dict]:
    """float32 logits at each sequence's last new token, and the updated caches.

    tokens: [R, T]; meta: RaggedMeta with leading R; cache: see `qwen35_lib.engine.cache`.
    Returns (logits [R, S, V], cache). The decoder is a scan over layer groups; the caches ride in the carry
    and each group's slice is updated in place (no second copy of the cache).
    """
    R, T = tokens.shape
    D = cfg.hidden_size
    h = weights["embed"][tokens]  # [R, T, D]

    def body(carry, xs):
        h, cache = carry
        w, gi = xs
        c = jax.tree.map(lambda a: a[gi], cache)  # this group's caches: [n, R, ...]
        i_gdn = i_attn = 0
        for p, kind in enumerate(cfg.layer_pattern):
            x = rms_norm(h, w["input_norm"][p], cfg.rms_norm_eps)
            if kind == LINEAR:
                layer = {n: c[n][i_gdn] for n in ("conv_q", "conv_k", "conv_v", "state")}
                x, layer = gdn_ragged_block(cfg, _take(w["gdn"], i_gdn), x, meta, layer)
                c = dict(c, **{n: c[n].at[i_gdn].set(layer[n]) for n in layer})
                i_gdn += 1
            else:
                scales = c["kv_scale"][i_attn] if "kv_scale" in c else None
                x, kv, scales = attention_ragged_block(cfg, _take(w["attn"], i_attn), x, meta, c["kv"][i_attn],
                                                       scales)
                c = dict(c, kv=c["kv"].at[i_attn].set(kv))
                if scales is not None:
                    c["kv_scale"] = c["kv_scale"].at[i_attn].set(scales)
                i_attn += 1
            h = h + x
            x = rms_norm(h, w["post_norm"][p], cfg.rms_norm_eps)
            h = h + moe_block(cfg, _take(w["moe"], p), x.reshape(R * T, D)).reshape(R, T, D)
        cache = jax.tree.map(lambda a, n: a.at[gi].set(n), cache, c)
        return (h, cache), None

    with jax.named_scope("layer_group"):
        (h, cache), _ = jax.lax.scan(body, (h, cache), (weights["layers"], jnp.arange(cfg.num_groups)))
    h = jnp.take_along_axis(h, meta.sample_tok[..., None], axis=1)  # [R, S, D]
    h = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("rsd,dv->rsv", h, weights["lm_head"], preferred_element_type=jnp.float32)
    return logits, cache
