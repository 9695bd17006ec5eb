"""Layouts: logical axes -> mesh axes, the one place where "how the model is split" is written.

Every weight and cache array declares logical axes (`qwen35_lib.weights`, `qwen35_lib.engine.cache`); a layout
maps them to the `('chip', 'core')` mesh. In the playbook's notation, for the 8-device mesh:

| layout        | attention / GDN                      | MoE                                     | requests (batch) |
|---------------|--------------------------------------|-----------------------------------------|------------------|
| `single`      | one device                           | one device                              | one rank         |
| `tp8`         | `W_q[D, Hq_x]`, `W_k[D, Hkv_x]`       | `W[E, D, F_x]` + all-reduce              | replicated       |
| `tp8_kvrep`   | `W_q[D, Hq_x]`, KV heads replicated   | `W[E, D, F_x]` + all-reduce              | replicated       |
| `dp4_tp2_ep8` | heads over `core`                    | `W[E_x, D, F]`, experts over all 8       | ranks over `chip`|
| `dp8_ep8`     | replicated weights, own requests     | `W[E_x, D, F]`, experts over all 8       | ranks over all 8 |

(x = both mesh axes, `('chip', 'core')`.) A logical axis whose size does not divide its mesh axes is kept
whole (replicated) and reported by `placement`, except where that would be a silent lie: `tp8` on 2 KV heads
is refused, and so is an expert count that does not divide the expert-parallel size.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from qwen35_lib.config import LAYOUTS, Config
from qwen35_lib.parallel.mesh import EIGHT, axis_size
from qwen35_lib.weights import ArrayInfo, declare, is_info

Axes = tuple[str, ...] | str | None


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    rules: tuple[tuple[str, Axes], ...]  # (logical axis, mesh axes); axes not named are replicated
    moe: str  # "local" (one device) | "tp" (expert FFN split, all-reduce) | "ep" (experts split, routed)
    summary: str

    def axes(self, logical: str | None) -> Axes:
        return dict(self.rules).get(logical) if logical else None

    @property
    def batch_axes(self) -> Axes:  # data-parallel ranks (the engine's R axis)
        return self.axes("batch")

    @property
    def ep_axes(self) -> Axes:
        return self.axes("experts")

    @property
    def tp_axes(self) -> Axes:  # the axes the expert FFN is split over under "tp"
        return self.axes("moe_ffn")

    def dp_size(self, mesh) -> int:
        return axis_size(mesh, self.batch_axes) if mesh is not None else 1


_TP_HEADS = (("q_heads", EIGHT), ("gdn_k_heads", EIGHT), ("gdn_v_heads", EIGHT), ("ffn", EIGHT),
             ("moe_ffn", EIGHT), ("vocab", EIGHT))
_LAYOUTS = {
    "single": Layout("single", (), "local", "everything on one device"),
    "tp8": Layout("tp8", _TP_HEADS + (("kv_heads", EIGHT),), "tp",
                  "naive 8-way tensor parallelism: every head axis and the expert FFN split 8 ways"),
    "tp8_kvrep": Layout("tp8_kvrep", _TP_HEADS, "tp",
                        "8-way tensor parallelism with the KV heads replicated on every device"),
    "dp4_tp2_ep8": Layout("dp4_tp2_ep8", (("batch", "chip"), ("q_heads", "core"), ("kv_heads", "core"),
                                          ("gdn_k_heads", "core"), ("gdn_v_heads", "core"), ("ffn", "core"),
                                          ("experts", EIGHT)), "ep",
                          "4 data-parallel ranks (one per chip), heads split over the 2 cores, experts over all 8"),
    "dp8_ep8": Layout("dp8_ep8", (("batch", EIGHT), ("experts", EIGHT)), "ep",
                      "8 data-parallel ranks (attention and GDN whole per device), experts over all 8"),
}
assert tuple(_LAYOUTS) == LAYOUTS


def get_layout(name: str) -> Layout:
    if name not in _LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; use one of {LAYOUTS}")
    return _LAYOUTS[name]


def check_layout(config: Config, mesh) -> Layout:
    """The config's layout, or a ValueError naming the constraint it breaks on `mesh` and the fix."""
    lay = get_layout(config.layout)
    if lay.name == "single":
        return lay
    if mesh is None:
        raise ValueError(f"layout {lay.name!r} needs a mesh: pass mesh=qwen35_lib.parallel.make_mesh() (8 devices "
                         "as ('chip', 'core'))")
    missing = set(EIGHT) - set(mesh.axis_names)
    if missing:
        raise ValueError(f"layout {lay.name!r} needs mesh axes {EIGHT}; this mesh has {mesh.axis_names}: build it "
                         "with qwen35_lib.parallel.make_mesh()")
    kv = axis_size(mesh, lay.axes("kv_heads"))
    if config.num_kv_heads % kv:
        raise ValueError(
            f"{config.num_kv_heads} KV heads cannot be split over {kv} devices of axes {lay.axes('kv_heads')} "
            f"(layout {lay.name!r}: {config.num_kv_heads}/{kv} heads per device); use layout 'dp8_ep8' or "
            f"replicate KV heads with 'tp8_kvrep' (every device then holds all {config.num_kv_heads}: {kv}x the "
            "KV-cache memory per device of an even split)")
    ep = axis_size(mesh, lay.ep_axes)
    if lay.moe == "ep" and config.num_experts % ep:
        raise ValueError(f"{config.num_experts} experts cannot be split evenly over {ep} devices (expert "
                         f"parallelism over {lay.ep_axes}): use an expert count that is a multiple of {ep}, "
                         "or a tensor-parallel layout ('tp8_kvrep')")
    tp = axis_size(mesh, lay.tp_axes)
    if lay.moe == "tp" and config.moe_ffn % tp:
        raise ValueError(f"expert FFN size {config.moe_ffn} cannot be split over {tp} devices (layout "
                         f"{lay.name!r}); use an EP layout ('dp8_ep8')")
    if lay.moe == "tp" and config.expert_dtype and (config.moe_ffn // config.fp8_block_size) % tp:
        raise ValueError(f"FP8 expert scales ({config.moe_ffn // config.fp8_block_size} blocks of "
                         f"{config.fp8_block_size} along the FFN) cannot be split over {tp} devices: use "
                         "expert_dtype=None or an EP layout ('dp8_ep8')")
    if lay.moe == "ep" and (config.hierarchical_rs or config.fuse_allgather) and config.routing != "replicate":
        raise ValueError("fuse_allgather and hierarchical_rs apply to routing='replicate' only; got "
                         f"routing={config.routing!r}")
    if lay.moe != "ep" and (config.hierarchical_rs or config.fuse_allgather):
        raise ValueError(f"fuse_allgather and hierarchical_rs apply to EP layouts with routing='replicate'; "
                         f"layout {lay.name!r} is not one")
    return lay


def spec(layout: Layout, mesh, logical_axes: tuple, shape: tuple) -> PartitionSpec:
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


def shardings(decl, layout: Layout, mesh):
    """NamedShardings for a tree of declared arrays (`ArrayInfo` leaves) under `layout` on `mesh`."""
    return jax.tree.map(lambda i: NamedSharding(mesh, spec(layout, mesh, i.logical_axes, i.shape)), decl,
                        is_leaf=is_info)


def weight_shardings(config: Config, mesh) -> dict:
    """NamedShardings for every weight of `config` under its layout (a tree like the weights)."""
    return shardings(declare(config), check_layout(config, mesh), mesh)


def shard_weights(config: Config, weights: dict, mesh) -> dict:
    """`weights` placed on `mesh` under the config's layout (arrays already placed so are not moved).

    Across processes (`jax.distributed`), each process passes its own copy, the same in every process, and
    supplies from it only the shards its devices hold (`device_put` would check equality with a collective per
    array); global arrays are resharded by `device_put`.
    """
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

