"""Where everything lands under a layout, worked out by arithmetic alone (no devices, nothing allocated).

`placement(config, layout, devices, ...)` answers, per device of a `('chip', 'core')` mesh: which query heads, KV
heads, GDN key/value heads, experts and requests it holds, and how many bytes of weights, KV cache and GDN state,
against the device's HBM. Everything is read from the same rules that shard the real arrays (`shardings.spec` over
the `ArrayInfo` declarations of `weights.declare` and `engine.cache.declare_cache`), so the bytes here are the
bytes `shard_weights` puts on a device (tested against real shards at CPU size).

The mesh is `plan.abstract_mesh(devices)`, sizes `(devices // 2, 2)`: only axis names and sizes are needed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from qwen35_lib import hardware as hw
from qwen35_lib.config import Config
from qwen35_lib.engine.cache import CacheShape, declare_cache
from qwen35_lib.parallel.shardings import spec
from qwen35_lib.plan import AXES, ServingPlan, abstract_mesh, axis_size, get_layout
from qwen35_lib.weights import ArrayInfo, declare, is_info

GiB = 2**30
# (label, logical axis, weight path whose spec places it): the axes a device's column shows
HELD = (("q_heads", "q_heads", ("layers", "attn", "w_q")), ("kv_heads", "kv_heads", ("layers", "attn", "w_k")),
        ("gdn_k_heads", "gdn_k_heads", ("layers", "gdn", "w_q")),
        ("gdn_v_heads", "gdn_v_heads", ("layers", "gdn", "w_v")),
        ("experts", "experts", ("layers", "moe", "w_gate_up")), ("moe_ffn", "moe_ffn", ("layers", "moe", "w_down")))
_WHY = (  # (substring of the bind check's message, the one-line reason behind the rule)
    ("KV heads cannot be split", "attention needs whole KV heads on a device: a fraction of a head has no "
                                 "K and V of its own, so a device cannot attend with it"),
    ("experts cannot be split", "expert parallelism gives every device the same block of whole experts; an uneven "
                                "split leaves devices with different expert counts and breaks the routing"),
    ("expert FFN size", "tensor-parallel MoE splits every expert's FFN columns evenly over the devices"),
    ("FP8 expert scales", "each device's FFN slice must hold whole FP8 scale blocks"),
    ("needs a mesh", "a multi-device layout needs the ('chip', 'core') mesh"),
    ("apply to", "the collective flags change the replicate routing's all-gathers and reduce-scatter only"),
)


@dataclasses.dataclass(frozen=True)
class DevicePlacement:
    """What one device holds: index ranges per axis (`range(64, 128)`: experts 64-127) and bytes."""

    device: int
    chip: int
    core: int
    holds: dict[str, range]  # label of HELD or "requests" -> indices on this device
    weight_bytes: int
    weight_bytes_by_part: dict[str, int]  # "routed experts", "attention", "GDN", "other"
    kv_bytes: int  # KV pages (+ FP8 scales) of the requests on this device, null page included
    gdn_state_bytes: int  # recurrent state + conv inputs, null slot included

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.gdn_state_bytes


@dataclasses.dataclass(frozen=True)
class Placement:
    """Per-device placement of one model under one layout; see `placement`."""

    model: str
    layout: str
    layout_summary: str
    devices: int
    mesh_shape: dict[str, int]
    hardware: str
    hbm_bytes_per_device: int
    usable_hbm_bytes_per_device: int  # what a program may use: where the fit is judged
    requests: int
    context_len: int
    kv_dtype: str
    ranks: int  # data-parallel ranks (the engine's R axis)
    cache_shape: CacheShape  # what `declare_cache` was given: per-rank pages and slots for `requests`
    sizes: dict[str, int]  # label -> size of the axis (q_heads: 32, experts: 512, requests: 512, ...)
    per_device: tuple[DevicePlacement, ...]
    axes: dict[str, str]  # label -> how it is placed ("split 8 ways over ('chip', 'core')", "replicated ...")
    replicated: tuple[str, ...]  # what the layout asks to split but cannot (does not divide), and what it costs
    copies: dict[str, float]  # weights / kv / gdn_state: bytes over all devices / bytes of one copy
    problem: str | None  # the bind check's message when the layout is refused, else None
    why: str | None  # one line: the reason behind the broken rule

    @property
    def weight_bytes_per_device(self) -> int:
        return max(d.weight_bytes for d in self.per_device)

    @property
    def kv_bytes_per_device(self) -> int:
        return max(d.kv_bytes for d in self.per_device)

    @property
    def gdn_state_bytes_per_device(self) -> int:
        return max(d.gdn_state_bytes for d in self.per_device)

    @property
    def total_bytes_per_device(self) -> int:
        return max(d.total_bytes for d in self.per_device)

    @property
    def fits(self) -> bool:
        return self.problem is None and self.total_bytes_per_device <= self.usable_hbm_bytes_per_device

    def summary(self) -> str:
        """A few lines: the verdict, bytes per device vs HBM, what is replicated."""
        mesh = " x ".join(f"{n} {a}" for a, n in self.mesh_shape.items())
        head = f"{self.model} under {self.layout} on {self.devices} devices ({mesh}), {self.requests} requests " \
               f"x {self.context_len:,} tokens, KV {self.kv_dtype}:"
        if self.problem:
            lines = [head, f"REFUSED: {self.problem}", f"why: {self.why}"]
        else:
            d = self
            verdict = "fits" if self.fits else "does NOT fit"
            lines = [head, f"per device: weights {_gib(d.weight_bytes_per_device)} + KV {_gib(d.kv_bytes_per_device)}"
                     f" + GDN state {_gib(d.gdn_state_bytes_per_device)} = {_gib(d.total_bytes_per_device)} of "
                     f"{_gib(d.usable_hbm_bytes_per_device)} usable HBM ({self.hardware}): {verdict}"]
        lines += [f"replicated: {r}" for r in self.replicated]
        lines.append("copies over the devices: " + ", ".join(f"{k} {v:.2f}x" for k, v in self.copies.items()))
        return "\n".join(lines)


def placement(config: Config, layout: str, devices: int = 8, kv_dtype: str | None = None, requests: int = 512,
              context_len: int = 8192, page_size: int = 16, hardware: str = "tpu7x-8") -> Placement:
    """Per-device placement and bytes of `config` under `layout` on `devices` devices.

    1. mesh: an AbstractMesh `('chip', 'core')` of sizes `(devices // 2, 2)` (one device: `(1, 1)`; `single`
       always uses one device);
    2. problem: the layout plan bound to that mesh and checked against the model (`ServingPlan.bind`); its message (and
       the reason behind the rule) when it refuses. The rest is still computed with `spec`'s fallback (dims that do not
       divide are replicated);
    3. caches: R = the layout's data-parallel size (KV heads as `tp_kvrep` duplicates them: the config the
       program runs, `BoundPlan.place`); requests go round-robin to the R ranks (the engine sends each
       new request to the least-loaded rank); each rank holds pages for ceil(requests / R) contexts of
       `context_len` tokens plus the null page, and as many GDN slots plus the null slot (`CacheShape.for_requests`,
       the one pool-for-N-requests formula);
    4. bytes per device: every weight and cache leaf's bytes / the number of shards its spec makes;
    5. per device: the index range of each axis in HELD and of the requests, from the device's mesh coordinates;
    6. what the layout asks to split but cannot (size does not divide), with the extra bytes per device it costs.
    """
    if layout == "single":
        devices = 1
    if devices < 1 or (devices > 1 and devices % 2):
        raise ValueError(f"devices={devices}: use 1 or an even count (chips of 2 TensorCores)")
    mesh = abstract_mesh(devices)  # [chips, cores]
    problem = why = None
    try:
        get_layout(layout).bind(mesh, config)
    except ValueError as e:
        problem = str(e)
        why = next((w for key, w in _WHY if key in problem), "")
    lay = get_layout(layout).bind(mesh)  # its sizes, unchecked: what a refused layout would hold
    r = lay.kv_replication(config)  # tp_kvrep: KV heads duplicated in the weights, r copies each
    config, unplaced = lay.place(config), config
    ranks = lay.dp
    kv_dtype = kv_dtype or config.dtype
    cache_shape = CacheShape.for_requests(requests, context_len, ranks=ranks, page_size=page_size, kv_dtype=kv_dtype)
    weights = _leaves(declare(config))
    cache = [(p, _kv_rows(config, i) if p[0] == "kv" else i) for p, i in _leaves(declare_cache(config, cache_shape))]
    w_bytes = {_part(path): 0 for path, _ in weights}
    for path, info in weights:
        w_bytes[_part(path)] += info.nbytes // _shards(lay, mesh, info)
    kv = sum(i.nbytes // _shards(lay, mesh, i) for p, i in cache if p[0] in ("kv", "kv_scale"))
    gdn = sum(i.nbytes // _shards(lay, mesh, i) for p, i in cache if p[0] not in ("kv", "kv_scale"))

    first: dict[tuple[str, ...], ArrayInfo] = {}
    for path, info in weights:  # an FP8 pair's value (first) rather than its scale
        first.setdefault(path, info)
    specs = {label: (logical, first.get(path)) for label, logical, path in HELD}
    sizes = {label: info.shape[info.logical_axes.index(logical)] for label, (logical, info) in specs.items() if info}
    sizes["kv_heads"] = sizes["kv_heads"] // r
    sizes["requests"] = requests
    batch_axes = _names(lay.batch_axes)
    per_device = []
    for d in range(devices):
        coords = dict(zip(AXES, divmod(d, mesh.shape["core"])))  # chip-major, core-minor, as make_mesh
        holds = {label: _block(lay, mesh, info, logical, coords) for label, (logical, info) in specs.items() if info}
        if r > 1:  # copies h*r .. h*r + r - 1 are of KV head h
            kvh = holds["kv_heads"]
            holds["kv_heads"] = range(kvh.start // r, (kvh.stop - 1) // r + 1)
        rank = _index(batch_axes, mesh, coords)
        holds["requests"] = range(rank, requests, ranks)
        per_device.append(DevicePlacement(d, coords["chip"], coords["core"], holds, sum(w_bytes.values()),
                                          dict(w_bytes), kv, gdn))
    once = {"weights": _total(_leaves(declare(unplaced))), "kv": _total(cache, ("kv", "kv_scale")) // r,
            "gdn_state": _total(cache) - _total(cache, ("kv", "kv_scale"))}
    on_devices = {"weights": sum(w_bytes.values()) * devices, "kv": kv * devices, "gdn_state": gdn * devices}
    return Placement(
        model=config.name, layout=layout, layout_summary=lay.summary, devices=devices, mesh_shape=dict(mesh.shape),
        hardware=hardware, hbm_bytes_per_device=hw.get(hardware).hbm_bytes_per_device,
        usable_hbm_bytes_per_device=hw.get(hardware).usable_hbm_bytes_per_device, requests=requests,
        context_len=context_len, kv_dtype=jnp.dtype(kv_dtype).name, ranks=ranks, cache_shape=cache_shape,
        sizes=sizes, per_device=tuple(per_device),
        axes={label: _how(lay, mesh, info, logical) for label, (logical, info) in specs.items() if info}
        | {"requests": f"{ranks} data-parallel ranks over {lay.batch_axes}" if ranks > 1 else "one rank: every "
           "device holds every request"},
        replicated=_not_divided(lay, mesh, weights + cache),
        copies={k: on_devices[k] / once[k] for k in once if once[k]}, problem=problem, why=why)


# ---------------------------------------------------------------------------------------------------------------


def shard_bytes_per_device(array: jax.Array, mesh) -> list[int]:
    """Bytes of `array`'s shards held by each device of `mesh`, in mesh order: measured from the array, to set
    against `placement`'s arithmetic."""
    return [sum(s.data.nbytes for s in array.addressable_shards if s.device == d) for d in mesh.devices.flat]


def _leaves(tree) -> list[tuple[tuple[str, ...], ArrayInfo]]:
    """(path keys, ArrayInfo) of every leaf; FP8 pairs give two leaves (value, scale) under the same path."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_info)
    return [(tuple(k.key for k in p if hasattr(k, "key")), i) for p, i in flat]


def _kv_rows(config: Config, info: ArrayInfo) -> ArrayInfo:
    """`kv` [.., 2*Hkv*d] counted as [.., 2*Hkv, d]: `spec` splits it only into whole K and V rows of heads."""
    return dataclasses.replace(info, shape=(*info.shape[:-1], 2 * config.num_kv_heads, config.head_dim),
                               logical_axes=(*info.logical_axes, None))


def _part(path: tuple[str, ...]) -> str:
    if "moe" in path and path[-1] in ("w_gate_up", "w_down"):
        return "routed experts"
    return {"attn": "attention", "gdn": "GDN"}.get(path[1] if len(path) > 1 else "", "other")


def _names(axes) -> tuple[str, ...]:
    return () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))


def _shards(lay: ServingPlan, mesh, info: ArrayInfo) -> int:
    return math.prod(axis_size(mesh, e) for e in spec(lay, mesh, info.logical_axes, info.shape) if e is not None)


def _total(leaves, first: tuple[str, ...] | None = None) -> int:
    return sum(i.nbytes for p, i in leaves if first is None or p[0] in first)


def _index(names: tuple[str, ...], mesh, coords: dict[str, int]) -> int:
    """The block index along a dim split over `names` (first name major) at mesh coordinates `coords`."""
    idx = 0
    for n in names:
        idx = idx * mesh.shape[n] + coords[n]
    return idx


def _dim_axes(lay: ServingPlan, mesh, info: ArrayInfo, logical: str) -> tuple[int, tuple[str, ...]]:
    """(size, mesh axes it is split over: () = replicated) of `info`'s `logical` dim under the layout."""
    dim = info.logical_axes.index(logical)
    entry = spec(lay, mesh, info.logical_axes, info.shape)[dim]
    return info.shape[dim], _names(entry)


def _block(lay: ServingPlan, mesh, info: ArrayInfo, logical: str, coords: dict[str, int]) -> range:
    n, names = _dim_axes(lay, mesh, info, logical)
    size = n // axis_size(mesh, names) if names else n
    start = _index(names, mesh, coords) * size
    return range(start, start + size)


def _how(lay: ServingPlan, mesh, info: ArrayInfo, logical: str) -> str:
    n, names = _dim_axes(lay, mesh, info, logical)
    if names:
        k = axis_size(mesh, names)
        return f"split {k} ways over {names}: {n // k} of {n} per device"
    wanted = _names(lay.axes(logical))
    if wanted:
        return f"replicated: {n} do not divide {axis_size(mesh, wanted)} ({wanted})"
    return f"whole on every device ({lay.name} does not split {logical})"


def _not_divided(lay: ServingPlan, mesh, leaves) -> tuple[str, ...]:
    """For each logical axis the layout maps but a leaf cannot split: sizes, and the extra bytes per device."""
    found: dict[str, tuple[set[int], int, int]] = {}  # logical -> (sizes, mesh size, extra bytes per device)
    for _, info in leaves:
        pspec = spec(lay, mesh, info.logical_axes, info.shape)
        for logical, n, entry in zip(info.logical_axes, info.shape, pspec):
            wanted = _names(lay.axes(logical))
            k = axis_size(mesh, wanted)
            if not wanted or entry is not None or k == 1 or n % k == 0:
                continue
            per_device = info.nbytes // _shards(lay, mesh, info)
            sizes, _, extra = found.get(logical, (set(), k, 0))
            found[logical] = (sizes | {n}, k, extra + per_device - per_device // k)
    return tuple(f"{logical}: {'/'.join(map(str, sorted(s)))} do not divide {k} → replicated: each device holds {k}x "
                 f"its even share (+{_gib(extra)} per device)" for logical, (s, k, extra) in found.items())


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= GiB or n == 0 else f"{n / 2**20:,.2f} MiB"


def fmt_range(r: range) -> str:
    """`range(64, 128)` -> "64-127"; `range(3, 512, 8)` -> "3, 11, ..., 507 (64)"; one index -> "5"."""
    if len(r) == 0:
        return "none"
    if len(r) == 1:
        return str(r[0])
    if r.step == 1:
        return f"{r[0]}-{r[-1]}"
    if len(r) <= 3:
        return ", ".join(map(str, r))
    return f"{r[0]}, {r[1]}, …, {r[-1]} ({len(r)})"


__all__ = ["DevicePlacement", "Placement", "fmt_range", "placement"]
