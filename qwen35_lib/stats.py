"""Sizes derived from the weight declarations (never typed in): parameters, active parameters, bytes, caches.

`model_stats` counts the main model (`weights.declare`): what the cost model, budgets and reports price.
`mtp_stats` counts the multi-token-prediction head (`weights.declare_mtp`) on its own, never added to those.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qwen35_lib.config import FULL, LINEAR, Config
from qwen35_lib.weights import BlockFP8, declare, declare_mtp, is_info, mtp_layer_config


@dataclasses.dataclass(frozen=True)
class ModelStats:
    total_params: int
    active_params: int  # per token: everything but the routed experts, plus top-k of them
    params_by_part: dict[str, int]  # embed, lm_head, attention, gdn, router, routed_experts, shared_experts, norms
    weight_bytes: int  # in the config's dtypes (FP8 experts counted with their scales)
    weight_bytes_by_dtype: dict[str, int]
    kv_bytes_per_token: int  # K and V of every attention layer, in the KV-cache dtype
    gdn_state_bytes_per_seq: int  # recurrent state + conv inputs of every GDN layer
    gdn_recurrent_bytes_per_seq: int
    gdn_conv_bytes_per_seq: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _part(path: tuple[str, ...]) -> str:
    if path[0] in ("embed", "lm_head", "fc"):  # fc: the MTP head's input projection
        return path[0]
    if path[0] in ("final_norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden") or path[-1].endswith("norm"):
        return "norms"
    if path[1] == "gdn":
        return "gdn"
    if path[1] == "attn":
        return "attention"
    name = path[2]
    if name == "router":
        return "router"
    if name in ("w_gate_up", "w_down"):
        return "routed_experts"
    return "shared_experts"


def model_stats(config: Config, kv_dtype: str | None = None) -> ModelStats:
    """Counts over `declare(config)`; FP8 scales count as bytes but not as parameters."""
    return _stats(config, declare(config), kv_dtype)


def mtp_stats(config: Config, kv_dtype: str | None = None) -> ModelStats:
    """The MTP head's own counts, over `declare_mtp(config)` (parts `fc`, `attention`, `router`, `routed_experts`,
    `shared_experts`, `norms`; the embedding and LM head it shares are the main model's, counted there only); its
    cache: the one attention layer's KV per token, no GDN state. Apart from `model_stats`, which it never changes."""
    return _stats(mtp_layer_config(config), declare_mtp(config), kv_dtype)


def _stats(config: Config, declared: dict, kv_dtype: str | None) -> ModelStats:
    """Counts over a declared tree whose layers are `config`'s (`config.layer_types`: the caches)."""
    by_part: dict[str, int] = {}
    by_dtype: dict[str, int] = {}

    def visit(path, node):
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        value = node.value if isinstance(node, BlockFP8) else node
        by_part[_part(keys)] = by_part.get(_part(keys), 0) + value.size
        for info in (node if isinstance(node, BlockFP8) else (node,)):
            name = jnp.dtype(info.dtype).name
            by_dtype[name] = by_dtype.get(name, 0) + info.nbytes

    jax.tree_util.tree_map_with_path(visit, declared, is_leaf=lambda n: is_info(n) or isinstance(n, BlockFP8))
    total = sum(by_part.values())
    routed = by_part.get("routed_experts", 0)
    active = total - routed + routed * config.num_experts_per_tok // config.num_experts

    kv_itemsize = jnp.dtype(kv_dtype or config.dtype).itemsize
    n_attn = config.layer_types.count(FULL)
    n_gdn = config.layer_types.count(LINEAR)
    kv = 2 * n_attn * config.num_kv_heads * config.head_dim * kv_itemsize
    rec = n_gdn * config.gdn_num_v_heads * config.gdn_k_head_dim * config.gdn_v_head_dim
    rec_bytes = rec * jnp.dtype(config.gdn_state_dtype).itemsize
    conv_bytes = n_gdn * config.gdn_conv_dim * (config.gdn_conv_kernel - 1) * jnp.dtype(config.dtype).itemsize
    return ModelStats(
        total_params=total, active_params=active, params_by_part=dict(sorted(by_part.items())),
        weight_bytes=sum(by_dtype.values()), weight_bytes_by_dtype=by_dtype,
        kv_bytes_per_token=kv, gdn_state_bytes_per_seq=rec_bytes + conv_bytes,
        gdn_recurrent_bytes_per_seq=rec_bytes, gdn_conv_bytes_per_seq=conv_bytes)
