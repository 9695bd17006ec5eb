"""The decoder stack and `forward`: embeddings, a scan over layer groups, final norm, LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.config import LINEAR, Config
from qwen35_lib.model.attention import attention_block
from qwen35_lib.model.deltanet import gdn_block
from qwen35_lib.model.layer_loop import LayerWeights, is_per_layer, layer_groups, per_layer_weights, prepare_weights
from qwen35_lib.model.layers import linear, rms_norm
from qwen35_lib.model.moe import moe_block
from qwen35_lib.model.parallelism import check_parallelism
from qwen35_lib.weights import abstract_weights


def residual_layer(cfg: Config, parallelism, w: LayerWeights, h: jax.Array, mixer, valid: jax.Array) -> jax.Array:
    """One layer, the one layer body of `forward` and the engine's ragged step. h: [B, T, D], valid: [B, T].

    1. x = mixer(rms_norm(h)) (GDN or attention; `mixer` closes over its caches); h += x;
    2. h += MoE(rms_norm(h)) on the flat tokens [B*T, D] (tokens not `valid` are routed to no expert).
    """
    B, T, D = h.shape
    h = h + mixer(w.mixer, rms_norm(h, w.input_norm, cfg.rms_norm_eps))
    x = rms_norm(h, w.post_norm, cfg.rms_norm_eps)
    return h + moe_block(cfg, w.moe, x.reshape(B * T, D), parallelism, valid.reshape(B * T)).reshape(B, T, D)


def _group(cfg: Config, parallelism, h: jax.Array, layers: list[LayerWeights], positions: jax.Array,
           lengths: jax.Array) -> jax.Array:
    """One layer group (e.g. 3 GDN + 1 attention), each layer followed by its MoE. h: [B, T, D]."""
    valid = jnp.arange(h.shape[1])[None, :] < lengths[:, None]  # [B, T]
    plan = parallelism.plan
    for kind, w in zip(cfg.layer_pattern, layers):
        if kind == LINEAR:
            mixer = lambda w, x: gdn_block(cfg, w, x, valid, plan=plan)[0]
        else:
            mixer = lambda w, x: attention_block(cfg, w, x, positions, lengths, plan)
        h = residual_layer(cfg, parallelism, w, h, mixer, valid)
    return h


@jax.jit(static_argnums=(0, 1), static_argnames=("return_hidden",))
def forward_prepared(cfg: Config, parallelism, weights: dict, token_ids: jax.Array, lengths: jax.Array, *,
                     return_hidden: bool = False):
    """`forward`'s jitted program on weights as given (stacked: the layer scan; per-layer: unrolled), unchecked:
    `forward` checks its arguments and prepares the weights for the plan first."""
    with jax.named_scope("model"):  # the profile's model part (`bench.profile`)
        return _forward_body(cfg, parallelism, weights, token_ids, lengths, return_hidden)


def _forward_body(cfg: Config, parallelism, weights: dict, token_ids: jax.Array, lengths: jax.Array,
                  return_hidden: bool = False):
    B, T = token_ids.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    h = weights["embed"][token_ids]  # [B, T, D]
    group = lambda h, layers, gi: _group(cfg, parallelism, h, layers, positions, lengths)
    h = layer_groups(cfg, weights["layers"], group, h)  # unrolled or a scan, as the weights come (`model.layer_loop`)
    h = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)  # [B, T, D]: the MTP head's input (`model.mtp`)
    with jax.named_scope("lm_head"):
        logits = linear(h, weights["lm_head"], dtype=jnp.float32)  # [B, T, V]
    return (logits, h) if return_hidden else logits


def forward(config: Config, weights: dict, token_ids, lengths=None, parallelism=None, *,
            return_hidden: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """float32 logits [B, T, V] for right-padded token rows [B, T]; `lengths` [B] gives each row's real length.

    Positions at or past a row's length are padding: they do not influence the real positions, and their
    logits are meaningless. Any T works (the GDN pads to whole chunks internally). A multi-device layout needs
    its `parallelism` (`qwen35_lib.forward` passes the layout's). `return_hidden=True` returns (logits, hidden
    [B, T, D]): the last hidden states after the final norm, in the config's dtype, which the LM head reads and
    the MTP head takes (`model.mtp.mtp_forward`); same program, same logits.
    """
    parallelism = check_parallelism(config, parallelism)
    token_ids = _check_tokens(config, token_ids)
    B, T = token_ids.shape
    if lengths is None:
        lengths = np.full((B,), T, np.int32)
    lengths = _check_lengths(lengths, B, T)
    check_weights(config, weights)
    weights = prepare_weights(config, weights, parallelism.plan)
    token_ids, lengths = jnp.asarray(token_ids, jnp.int32), jnp.asarray(lengths, jnp.int32)
    return forward_prepared(config, parallelism, weights, token_ids, lengths, return_hidden=return_hidden)


def lower_forward(config: Config, weights: dict, token_ids, lengths, parallelism=None) -> jax.stages.Lowered:
    """`forward`'s jitted program lowered for these arguments, which may be sharded arrays or abstract
    `jax.ShapeDtypeStruct`s: `.compile()` gives the executable, its HLO (`.as_text()`), `cost_analysis()` and
    `memory_analysis()`; calling it takes (weights, token_ids, lengths)."""
    if not isinstance(token_ids, jax.ShapeDtypeStruct):
        token_ids = jnp.asarray(_check_tokens(config, token_ids), jnp.int32)
        lengths = jnp.asarray(_check_lengths(lengths, *token_ids.shape), jnp.int32)
    parallelism = check_parallelism(config, parallelism)
    weights = prepare_weights(config, weights, parallelism.plan)
    return forward_prepared.lower(config, parallelism, weights, token_ids, lengths)


def _check_tokens(config: Config, token_ids):
    dtype = getattr(token_ids, "dtype", None)
    if dtype is None:
        token_ids = np.asarray(token_ids)
        dtype = token_ids.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"token_ids must be an integer array; got dtype {dtype}. Token ids are vocabulary indices, "
                        "e.g. np.asarray(ids, np.int32)")
    if token_ids.ndim != 2:
        hint = " (add a batch dim: token_ids[None])" if token_ids.ndim == 1 else ""
        raise ValueError(f"token_ids must be [batch, seq]; got shape {tuple(token_ids.shape)}{hint}")
    if token_ids.shape[1] == 0:
        raise ValueError("token_ids has no tokens (seq length 0)")
    if not isinstance(token_ids, jax.core.Tracer):
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {config.vocab_size}) of {config.name}")
    return token_ids


def _check_lengths(lengths, B: int, T: int) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be {B} integers (one per row); got {lengths.dtype} of shape {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > T:
        raise ValueError(f"each length must be in [1, {T}] (the padded row length); got {lengths.tolist()}")
    return lengths


def check_weights(config: Config, weights: dict) -> None:
    """Raise a clear error when `weights` does not have the tree, shapes and dtypes `config` declares (stacked,
    or split into per-layer leaves by `model.layer_loop.per_layer_weights`)."""
    expected = abstract_weights(config)
    if is_per_layer(weights.get("layers") if isinstance(weights, dict) else None):
        expected = dict(expected, layers=jax.eval_shape(lambda l: per_layer_weights(config, {"layers": l})["layers"],
                                                        expected["layers"]))
    # a re-laid weight (panel-packed by `prepare_weights`) is checked by its logical shape and dtype
    leaf = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    exp_leaves, exp_tree = jax.tree_util.tree_flatten_with_path(expected, is_leaf=leaf)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(weights, is_leaf=leaf)
    if exp_tree != got_tree:
        exp_paths = {jax.tree_util.keystr(p) for p, _ in exp_leaves}
        got_paths = {jax.tree_util.keystr(p) for p, _ in got_leaves}
        raise ValueError(f"weights do not match config {config.name!r}: missing {sorted(exp_paths - got_paths)[:8]}, "
                         f"unexpected {sorted(got_paths - exp_paths)[:8]} (were they made for another config?)")
    for (path, e), (_, g) in zip(exp_leaves, got_leaves):
        if tuple(g.shape) != tuple(e.shape) or jnp.dtype(g.dtype) != jnp.dtype(e.dtype):
            raise ValueError(f"weight {jax.tree_util.keystr(path)} is {g.dtype}{list(g.shape)} but config "
                             f"{config.name!r} declares {e.dtype}{list(e.shape)}")
