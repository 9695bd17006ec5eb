"""Shardings: a layout's logical axes -> mesh axes, applied to arrays (PartitionSpecs, NamedShardings, placed
weights). The rules themselves are the serving plan's (`qwen35_lib.plan`: one `ServingPlan` per layout name or
stage), checked against a model and a mesh when it is bound there (`plan.bind(mesh, config)`); every function here
takes the bound plan.

Every weight and cache array declares logical axes (`qwen35_lib.weights`, `qwen35_lib.engine.cache`); a layout
maps them to the `('chip', 'core')` mesh. A logical axis whose size does not divide its mesh axes is kept whole
(replicated) and reported by `placement`, except where that would be a silent lie: `tp` on 2 KV heads over more
than 2 devices is refused (`tp_kvrep` duplicates them instead), and so is an expert count that does not divide
the expert-parallel size.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from qwen35_lib.config import Config
from qwen35_lib.plan import BoundPlan, ServingPlan, axis_size
from qwen35_lib.weights import ArrayInfo, declare, is_info


def placed_config(config: Config, plan: ServingPlan | BoundPlan, mesh=None) -> Config:
    """The config a program runs under `plan` bound to `mesh` (default: the bound plan's own): under `tp_kvrep`,
    with the duplicated KV heads, and the plan's GDN state dtype (`BoundPlan.placed`: the one placed when it was
    bound, where `config` is that model)."""
    return (plan if mesh is None else plan.bound(mesh)).placed(config)


def spec(layout: ServingPlan, mesh, logical_axes: tuple, shape: tuple) -> PartitionSpec:
    """The PartitionSpec of an array with `logical_axes` and `shape` under `layout` on `mesh`.

    A dim is split only if its size divides the mesh axes' size and those axes are not used by an earlier dim.
    """
    used: set[str] = set()
    out = []
    for logical, n in zip(logical_axes, shape):
        axes = layout.axes(logical)
        names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        if names and n % axis_size(mesh, names) == 0 and not used & set(names):
            used |= set(names)
            out.append(names[0] if len(names) == 1 else names)
        else:
            out.append(None)
    return PartitionSpec(*out)


def shardings(decl, layout: ServingPlan, mesh):
    """NamedShardings for a tree of declared arrays (`ArrayInfo` leaves) under `layout` on `mesh`."""
    return jax.tree.map(lambda i: NamedSharding(mesh, spec(layout, mesh, i.logical_axes, i.shape)), decl,
                        is_leaf=is_info)


def weight_shardings(config: Config, plan: ServingPlan, mesh) -> dict:
    """NamedShardings for every weight of `config` under the bound `plan`, as placed on `mesh` (`placed_config`:
    the duplicated KV heads of `tp_kvrep`); a tree like the weights."""
    return shardings(declare(placed_config(config, plan, mesh)), plan, mesh)


def duplicate_kv_heads(config: Config, plan: ServingPlan, weights: dict, mesh, declared=declare) -> dict:
    """`weights` with each KV projection's heads repeated as `placed_config` says (head h -> copies h*r .. h*r +
    r - 1, so query head q still reads a copy of head q // (Hq / Hkv)); arrays already so are kept. `declared`: the
    tree's declaration of a config (`weights.declare`; the MTP head's `weights.declare_mtp`)."""
    want = declared(placed_config(config, plan, mesh))  # config may be placed already: shapes decide

    def dup(x, info):
        if not is_info(info) or "kv_heads" not in info.logical_axes:
            return x
        axis = info.logical_axes.index("kv_heads")
        r = info.shape[axis] // x.shape[axis]
        return x if r == 1 else jax.numpy.repeat(x, r, axis=axis)

    return jax.tree.map(dup, weights, want, is_leaf=lambda v: is_info(v) or not isinstance(v, dict))


def shard_weights(config: Config, plan: ServingPlan, weights: dict, mesh, declared=declare) -> dict:
    """`weights` placed on `mesh` under the bound `plan` (arrays already placed so are not moved), their KV heads
    duplicated as the plan says (`duplicate_kv_heads`); `declared` as there (the MTP head: `weights.declare_mtp`).

    Across processes (`jax.distributed`), each process passes its own copy, the same in every process, and
    supplies from it only the shards its devices hold (`device_put` would check equality with a collective per
    array); global arrays are resharded by `device_put`.
    """
    weights = duplicate_kv_heads(config, plan, weights, mesh, declared)
    placed = shardings(declared(placed_config(config, plan, mesh)), plan, mesh)
    if jax.process_count() == 1:
        return jax.device_put(weights, placed)
    return jax.tree.map(_place_local_copy, weights, placed)


def _place_local_copy(x, sharding: NamedSharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batch_sharding(plan: ServingPlan, mesh, ndim: int) -> NamedSharding:
    """For per-rank engine inputs [R, ...]: R over the plan's batch axes."""
    return NamedSharding(mesh, PartitionSpec(plan.batch_axes, *([None] * (ndim - 1))))


def leaf_infos(config: Config) -> list[tuple[str, ArrayInfo]]:
    """(path, ArrayInfo) of every weight leaf, FP8 pairs flattened."""
    flat, _ = jax.tree_util.tree_flatten_with_path(declare(config), is_leaf=is_info)
    return [(jax.tree_util.keystr(p), i) for p, i in flat]



__all__ = ["batch_sharding", "duplicate_kv_heads", "leaf_infos", "placed_config", "shard_weights", "shardings", "spec",
           "weight_shardings"]
