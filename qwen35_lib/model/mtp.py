"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next: one more decoder layer that drafts the token after
the next one from the main model's last hidden state.

The public definition is vLLM's (`vllm/model_executor/models/qwen3_5_mtp.py`, `qwen3_next_mtp.py`; transformers
drops `mtp.*` at load and never runs the head). Its weights are a tree of their own (`declare_mtp`; random:
`init_mtp_weights`; both in `qwen35_lib.weights`, beside every other declaration and below the size accounting,
`qwen35_lib.stats.mtp_stats`, that counts them), loaded apart from the main model's (`qwen35_lib.checkpoint.load_mtp`),
so the main model's programs, budgets and counts do not see them:

    pre_fc_norm_embedding [D], pre_fc_norm_hidden [D]   zero-centred RMSNorms
    fc [2, D, D]       HF `mtp.fc.weight` [D, 2D] applied to cat([normed embedding, normed hidden]): fc[0] takes the
                       embedding half, fc[1] the hidden half
    layers             one full-attention decoder layer with its MoE, declared as the `layers` tree of a one-layer
                       model (`mtp_layer_config`): leaves [1, 1, ...] (HF `mtp.layers.0.*`, named as a main layer)
    norm [D]           zero-centred RMSNorm before the LM head
The embedding and the LM head are the main model's (`mtp_use_dedicated_embeddings` is false in every Qwen3.5 config).

Which positions: row position t takes h_t (the main model's hidden state at t, AFTER its final norm: vLLM's
Qwen3.5 / Qwen3-Next models return the normed states and the proposer feeds those) with token t+1 (the token the
main model sampled there, or the prompt's next one), and is computed at RoPE position t (vLLM's proposer copies the
target positions and shifts the ids by one). Its logits are the draft for token t+2. The head's attention keeps its
own KV entries, one per position, like a main attention layer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.config import Config
from qwen35_lib.model.attention import attention_block
from qwen35_lib.model.decoder import residual_layer
from qwen35_lib.model.layer_loop import group_layers
from qwen35_lib.model.layers import linear, rms_norm
from qwen35_lib.model.parallelism import check_parallelism
from qwen35_lib.model.ragged import ragged_forward
from qwen35_lib.weights import declare_mtp, init_mtp_weights, is_info, mtp_layer_config

__all__ = ["declare_mtp", "init_mtp_weights", "mtp_forward", "mtp_input", "mtp_layer_config", "ragged_mtp"]


def mtp_forward(config: Config, weights: dict, mtp_weights: dict, hidden, next_ids, lengths=None,
                positions=None, parallelism=None) -> tuple[jax.Array, jax.Array]:
    """The head over right-padded rows: (its hidden state [B, T, D], float32 draft logits [B, T, V]).

    hidden [B, T, D]: the main model's last hidden states after its final norm; next_ids [B, T]: the token after
    each position; lengths [B] (default T): each row's real length; positions [B, T] (default 0..T-1): each
    position's RoPE position. `weights`: the main model's tree (its `embed` and `lm_head` are read); `mtp_weights`:
    `declare_mtp`'s tree. Logits at t draft token t+2; the returned hidden state is what a further draft step takes
    as its `hidden`.
    1. e = rms_norm(embed[next_ids], pre_fc_norm_embedding); g = rms_norm(hidden, pre_fc_norm_hidden);
    2. x = cat([e, g]) @ fc;
    3. x = the decoder layer (gated GQA attention, causal over each row, then the MoE, each with its residual);
    4. out = rms_norm(x, norm); logits = out @ lm_head.
    """
    parallelism = check_parallelism(config, parallelism)
    _check_mtp_weights(config, mtp_weights)
    next_ids = jnp.asarray(next_ids, jnp.int32)
    B, T = next_ids.shape
    if tuple(np.shape(hidden)) != (B, T, config.hidden_size):
        raise ValueError(f"hidden is {tuple(np.shape(hidden))}, next_ids {(B, T)}: hidden must be [B, T, "
                         f"{config.hidden_size}] (the main model's last hidden state at each position)")
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if positions is None else \
        jnp.asarray(positions, jnp.int32)
    hidden = jnp.asarray(hidden, config.dtype)
    return _mtp_forward(config, parallelism, mtp_weights, weights["embed"], weights["lm_head"], hidden, next_ids,
                        positions, lengths)


@jax.jit(static_argnums=(0, 1))
def _mtp_forward(cfg: Config, parallelism, w: dict, embed: jax.Array, lm_head: jax.Array, hidden: jax.Array,
                 next_ids: jax.Array, positions: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    with jax.named_scope("mtp"):
        x = mtp_input(cfg, w, embed, hidden, next_ids)
        lc = mtp_layer_config(cfg)
        (layer,) = group_layers(lc, jax.tree.map(lambda a: a[0], w["layers"]))  # leaves [1, ...] -> [...]
        valid = jnp.arange(x.shape[1])[None, :] < lengths[:, None]  # [B, T]
        mixer = lambda mw, y: attention_block(lc, mw, y, positions, lengths, parallelism.plan)
        x = residual_layer(lc, parallelism, layer, x, mixer, valid)  # [B, T, D]
        out = rms_norm(x, w["norm"], cfg.rms_norm_eps)
        with jax.named_scope("lm_head"):
            return out, linear(out, lm_head, dtype=jnp.float32)  # [B, T, D], [B, T, V]


def mtp_input(cfg: Config, w: dict, embed: jax.Array, hidden: jax.Array, next_ids: jax.Array) -> jax.Array:
    """The head's layer input [..., D]: steps 1-2 of `mtp_forward` (hidden [..., D], next_ids [...])."""
    e = rms_norm(embed[next_ids], w["pre_fc_norm_embedding"], cfg.rms_norm_eps)  # [..., D]
    g = rms_norm(hidden, w["pre_fc_norm_hidden"], cfg.rms_norm_eps)  # [..., D]
    with jax.named_scope("fc"):
        return linear(jnp.stack([e, g], axis=-2), w["fc"], contract=2)  # [..., 2, D] @ [2, D, D] -> [..., D]


def ragged_mtp(cfg: Config, weights: dict, mtp_weights: dict, cache: dict, hidden: jax.Array, next_ids: jax.Array,
               meta, parallelism=None) -> tuple[jax.Array, dict, jax.Array]:
    """The head over a ragged batch (the engine's drafts): hidden [R, T, D] and next_ids [R, T] as `mtp_forward`
    takes them, `meta` a RaggedMeta whose `sample_tok` [R, S] names the rows whose drafts are wanted; `cache`: the
    head's own paged KV pool (`engine.cache.init_cache(mtp_layer_config(cfg), shape)`), addressed by the main
    model's page tables. Returns (float32 draft logits [R, S, V], cache, the head's normed hidden states [R, T, D])."""
    head = dict(embed=weights["embed"], layers=mtp_weights["layers"], final_norm=mtp_weights["norm"],
                lm_head=weights["lm_head"])
    with jax.named_scope("mtp"):
        x = mtp_input(cfg, mtp_weights, weights["embed"], hidden, next_ids)
        return ragged_forward(mtp_layer_config(cfg), head, cache, None, meta, parallelism, embedded=x,
                              return_hidden=True)


def _check_mtp_weights(config: Config, mtp_weights: dict) -> None:
    """A clear error when `mtp_weights` is not `declare_mtp(config)`'s tree of shapes and dtypes."""
    leaf = lambda x: is_info(x) or (hasattr(x, "shape") and hasattr(x, "dtype"))
    want, want_tree = jax.tree_util.tree_flatten_with_path(declare_mtp(config), is_leaf=is_info)
    got, got_tree = jax.tree_util.tree_flatten_with_path(mtp_weights, is_leaf=leaf)
    if want_tree != got_tree:
        raise ValueError(f"mtp_weights is not the MTP head of {config.name!r}: expected the leaves "
                         f"{[jax.tree_util.keystr(p) for p, _ in want][:6]}...; load it with "
                         "qwen35_lib.checkpoint.load_mtp")
    for (path, i), (_, a) in zip(want, got):
        if (tuple(a.shape), jnp.dtype(a.dtype)) != (i.shape, jnp.dtype(i.dtype)):
            raise ValueError(f"MTP weight {jax.tree_util.keystr(path)} is {jnp.dtype(a.dtype)}{list(a.shape)} but "
                             f"config {config.name!r} declares {jnp.dtype(i.dtype)}{list(i.shape)}")
