"""Layouts: logical axes -> mesh axes, applied. The rules themselves are the layout plans of
`qwen35_lib.parallel.plan` (one `ServingPlan` per layout name; `Layout` is that class).

Every weight and cache array declares logical axes (`qwen35_lib.weights`, `qwen35_lib.engine.cache`); a layout
maps them to the `('chip', 'core')` mesh. A logical axis whose size does not divide its mesh axes is kept whole
(replicated) and reported by `placement`, except where that would be a silent lie: `tp` on 2 KV heads over more
than 2 devices is refused (`tp_kvrep` duplicates them instead), and so is an expert count that does not divide
the expert-parallel size.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from qwen35_lib.config import Config
from qwen35_lib.parallel.mesh import AXES, axis_size
from qwen35_lib.parallel.plan import Axes, ServingPlan, get_layout, plan_of
from qwen35_lib.weights import ArrayInfo, declare, is_info

Layout = ServingPlan  # a layout is the plan of a layout name: one record, not a second class


def check_layout(config: Config, mesh) -> ServingPlan:
    """The config's plan (layout, routing, flags) bound to `mesh`, or a ValueError naming the constraint it breaks
    on `mesh` and the fix."""
    lay = plan_of(config)
    if lay.name == "single":
        return lay
    if mesh is None:
        raise ValueError(f"layout {lay.name!r} needs a mesh: pass mesh=qwen35_lib.parallel.make_mesh() (the devices "
                         "as ('chip', 'core'))")
    missing = set(AXES) - set(mesh.axis_names)
    if missing:
        raise ValueError(f"layout {lay.name!r} needs mesh axes {AXES}; this mesh has {mesh.axis_names}: build it "
                         "with qwen35_lib.parallel.make_mesh()")
    n = axis_size(mesh, AXES)
    if lay.devices is not None and n != lay.devices:
        raise ValueError(f"layout {lay.name!r} is the {lay.devices}-device instance of {lay.general!r}; this mesh has "
                         f"{n} devices: use layout {lay.general!r} (its sizes come from the mesh)")
    lay = lay.bind(mesh)
    kv = axis_size(mesh, lay.axes("kv_heads"))
    heads = config.num_kv_heads * lay.kv_replication(config)
    if heads % kv and not lay.kv_replicated:  # tp_kvrep keeps what does not divide whole on every device
        dp_ep, kvrep = ("dp8_ep8", "tp8_kvrep") if n == 8 else ("dp_ep", "tp_kvrep")
        raise ValueError(
            f"{config.num_kv_heads} KV heads cannot be split over {kv} devices of axes {lay.axes('kv_heads')} "
            f"(layout {lay.name!r}: {config.num_kv_heads}/{kv} heads per device); use layout {dp_ep!r} or "
            f"replicate KV heads with {kvrep!r} (each device then keeps the one its query heads read: "
            f"{kv // math.gcd(kv, config.num_kv_heads)}x the KV-cache memory of an even split)")
    if heads % kv:  # tp_kvrep that cannot duplicate evenly: KV heads whole on every device
        lay = dataclasses.replace(lay, kv_whole=True)
    ep = lay.ep
    if lay.moe == "ep" and config.num_experts % ep:
        raise ValueError(f"{config.num_experts} experts cannot be split evenly over {ep} devices (expert "
                         f"parallelism over {lay.ep_axes}): use an expert count that is a multiple of {ep}, "
                         "or a tensor-parallel layout ('tp_kvrep')")
    tp = axis_size(mesh, lay.tp_axes)
    if lay.moe == "tp" and config.moe_ffn % tp:
        raise ValueError(f"expert FFN size {config.moe_ffn} cannot be split over {tp} devices (layout "
                         f"{lay.name!r}); use an EP layout ('dp_ep')")
    if lay.moe == "tp" and config.expert_dtype and (config.moe_ffn // config.fp8_block_size) % tp:
        raise ValueError(f"FP8 expert scales ({config.moe_ffn // config.fp8_block_size} blocks of "
                         f"{config.fp8_block_size} along the FFN) cannot be split over {tp} devices: use "
                         "expert_dtype=None or an EP layout ('dp_ep')")
    if lay.moe == "ep" and (config.hierarchical_rs or config.fuse_allgather) and config.routing != "replicate":
        raise ValueError("fuse_allgather and hierarchical_rs apply to routing='replicate' only; got "
                         f"routing={config.routing!r}")
    if lay.moe != "ep" and (config.hierarchical_rs or config.fuse_allgather):
        raise ValueError(f"fuse_allgather and hierarchical_rs apply to EP layouts with routing='replicate'; "
                         f"layout {lay.name!r} is not one")
    return lay


def placed_config(config: Config, mesh) -> Config:
    """The config a program runs on `mesh`: under `tp_kvrep`, with the duplicated KV heads (`ServingPlan.
    placed_config`); unchanged otherwise. Checked (`check_layout`)."""
    lay = check_layout(config, mesh)
    return config if lay.name == "single" else lay.placed_config(config)


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


def weight_shardings(config: Config, mesh) -> dict:
    """NamedShardings for every weight of `config` under its layout, as placed on `mesh` (`placed_config`: the
    duplicated KV heads of `tp_kvrep`); a tree like the weights."""
    return shardings(declare(placed_config(config, mesh)), check_layout(config, mesh), mesh)


def duplicate_kv_heads(config: Config, weights: dict, mesh) -> dict:
    """`weights` with each KV projection's heads repeated as `placed_config` says (head h -> copies h*r .. h*r +
    r - 1, so query head q still reads a copy of head q // (Hq / Hkv)); arrays already so are kept."""
    want = declare(placed_config(config, mesh))  # config may be placed already: shapes decide

    def dup(x, info):
        if not is_info(info) or "kv_heads" not in info.logical_axes:
            return x
        axis = info.logical_axes.index("kv_heads")
        r = info.shape[axis] // x.shape[axis]
        return x if r == 1 else jax.numpy.repeat(x, r, axis=axis)

    return jax.tree.map(dup, weights, want, is_leaf=lambda v: is_info(v) or not isinstance(v, dict))


def shard_weights(config: Config, weights: dict, mesh) -> dict:
    """`weights` placed on `mesh` under the config's layout (arrays already placed so are not moved).

    Across processes (`jax.distributed`), each process passes its own copy, the same in every process, and
    supplies from it only the shards its devices hold (`device_put` would check equality with a collective per
    array); global arrays are resharded by `device_put`.
    """
    weights = duplicate_kv_heads(config, weights, mesh)
    shardings = weight_shardings(config, mesh)
    if jax.process_count() == 1:
        return jax.device_put(weights, shardings)
    return jax.tree.map(_place_local_copy, weights, shardings)


def _place_local_copy(x, sharding: NamedSharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batch_sharding(config: Config, mesh, ndim: int) -> NamedSharding:
    """For per-rank engine inputs [R, ...]: R over the layout's batch axes."""
    lay = get_layout(config.layout)
    return NamedSharding(mesh, PartitionSpec(lay.batch_axes, *([None] * (ndim - 1))))


def leaf_infos(config: Config) -> list[tuple[str, ArrayInfo]]:
    """(path, ArrayInfo) of every weight leaf, FP8 pairs flattened."""
    flat, _ = jax.tree_util.tree_flatten_with_path(declare(config), is_leaf=is_info)
    return [(jax.tree_util.keystr(p), i) for p, i in flat]



__all__ = ["Axes", "Layout", "ServingPlan", "batch_sharding", "check_layout", "duplicate_kv_heads", "get_layout",
           "leaf_infos", "placed_config", "shard_weights", "shardings", "spec", "weight_shardings"]
