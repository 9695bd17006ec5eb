"""The sliced load: each device's shard of every leaf read straight from the memory-mapped files, slice by slice,
so the host never holds a whole leaf (`load_sliced`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.checkpoint.files import Progress, read
from qwen35_lib.checkpoint.names import Group, Op, Path
from qwen35_lib.weights import ArrayInfo

Box = tuple[tuple[int, int], ...]  # one device's part of a leaf: (start, stop) per dim
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def load_sliced(groups: list[Group], infos: dict[Path, ArrayInfo], tensors: dict, block: int | None,
                 shardings: dict[Path, Any], bar: Progress) -> dict[Path, jax.Array]:
    """Every leaf straight into its shards, the host holding one slice of one source tensor at a time.

    `chunk` = the largest piece one op writes into one device's shard of one leaf (e.g. one expert's
    [D, 2, F] under dp8_ep8, its [D, 2, F / 8] under tp8): the host-memory unit. Per group of leaves:
    1. Each addressable device's box of every leaf (`addressable_devices_indices_map`); devices with the same
       boxes (replicas) are built once.
    2. Per box: if the group's shards there fit in `chunk`, they are assembled on the host and put on the box's
       devices. Otherwise every shard starts as zeros on its devices and each op's piece is written into it in
       place (`_write`: a donated dynamic-update-slice), so the host holds one piece at a time.
    3. An op is read only for the boxes that contain its index, and only its sources' slice: fused expert tensors
       ([E, ...], `op.experts`) are read for the box's experts' rows only (FP8 dequantized on those rows).
    4. `make_array_from_single_device_arrays` makes each leaf from its device shards.
    Cost: a source is read (from the page cache after the first time) once per distinct box that needs it: once
    under EP for expert tensors, once per device under TP. The host's transient per op is its sources as read
    (dequantized to float32 if FP8) and transformed, before the cut to the box: under TP a whole tensor, not 1/8.
    """
    chunk = max(_piece_bytes(g, infos, shardings) for g in groups)
    boxed = [(g, _boxes(g, infos, shardings)) for g in groups]
    bar.start(sum(len(ops) for _, boxes in boxed for ops, _, _ in boxes),
              sum(op_bytes(op, rows, tensors) for _, boxes in boxed for ops, rows, _ in boxes for op in ops))
    out: dict[Path, jax.Array] = {}
    for group, boxes in boxed:
        shards: dict[str, dict[Any, jax.Array]] = {key: {} for key in group.leaves}
        for ops, rows, (box, devices) in boxes:
            for key, arrays in _build_box(group, ops, rows, box, devices, infos, tensors, block, chunk, bar).items():
                shards[key].update(zip(devices, arrays, strict=True))
        for key, p in group.leaves.items():
            sharding = shardings[p]
            order = list(sharding.addressable_devices_indices_map(infos[p].shape))
            out[p] = jax.make_array_from_single_device_arrays(infos[p].shape, sharding,
                                                              [shards[key][d] for d in order])
    return out


def _boxes(group: Group, infos: dict[Path, ArrayInfo], shardings: dict[Path, Any]
           ) -> list[tuple[list[Op], tuple[int, int] | None, tuple[dict[str, Box], list]]]:
    """The distinct boxes of `group` over the addressable devices: (ops inside the box, the expert rows its fused
    expert ops read or None, (box of each leaf, the devices holding it))."""
    k = len(group.ops[0].index)
    assert all(len(op.index) == k for op in group.ops), group.leaves
    maps = {key: shardings[p].addressable_devices_indices_map(infos[p].shape) for key, p in group.leaves.items()}
    by_box: dict[tuple, list] = {}
    for d in next(iter(maps.values())):
        box = tuple(tuple(s.indices(n)[:2] for s, n in zip(maps[key][d], infos[p].shape, strict=True))
                    for key, p in group.leaves.items())
        by_box.setdefault(box, []).append(d)
    out = []
    for box, devices in by_box.items():
        boxes = dict(zip(group.leaves, box, strict=True))
        ops = [op for op in group.ops if any(_inside(op.index, b) for b in boxes.values())]
        rows = None
        if any(op.experts for op in ops):  # fused experts: the leaves' dim k is the sources' dim 0
            spans = {b[k] for b in boxes.values()}
            rows = (min(a for a, _ in spans), max(z for _, z in spans))
        out.append((ops, rows, (boxes, devices)))
    return out


def _inside(index: tuple[int, ...], box: Box) -> bool:
    return all(a <= i < z for i, (a, z) in zip(index, box))


def _piece_bytes(group: Group, infos: dict[Path, ArrayInfo], shardings: dict[Path, Any]) -> int:
    """The largest piece one op of `group` writes into one device's shard of one of its leaves."""
    k = len(group.ops[0].index)
    return max(math.prod(shardings[p].shard_shape(infos[p].shape)[k:]) * np.dtype(infos[p].dtype).itemsize
               for p in group.leaves.values())


def op_bytes(op: Op, rows: tuple[int, int] | None, tensors: dict) -> int:
    """The stored bytes an op reads (its sources' rows only for fused experts)."""
    total = 0
    for n in op.sources:
        info = tensors[n].tensors[n]
        nbytes = info.end - info.begin
        total += nbytes * (rows[1] - rows[0]) // info.shape[0] if op.experts and rows and info.shape[0] else nbytes
    return total


def _build_box(group: Group, ops: list[Op], rows: tuple[int, int] | None, boxes: dict[str, Box], devices: list,
               infos: dict[Path, ArrayInfo], tensors: dict, block: int | None, chunk: int, bar: Progress
               ) -> dict[str, list[jax.Array]]:
    """The shards of `group`'s leaves in `boxes`, one per device of `devices` (see `load_sliced`, step 2)."""
    k = len(group.ops[0].index)
    leaves = {key: infos[p] for key, p in group.leaves.items()}
    shapes = {key: tuple(z - a for a, z in boxes[key]) for key in leaves}
    on_host = sum(math.prod(shapes[key]) * np.dtype(i.dtype).itemsize for key, i in leaves.items()) <= chunk
    host = {key: np.empty(shapes[key], i.dtype) for key, i in leaves.items()} if on_host else {}
    dev = {} if on_host else {key: [_zeros(shapes[key], i.dtype, d) for d in devices] for key, i in leaves.items()}
    for op in ops:
        cut = rows if op.experts else None
        pieces = op.split(*(read(tensors, n, block, op.raw, cut) for n in op.sources))
        bar.update(1, op_bytes(op, cut, tensors))
        for key, piece in pieces.items():
            b = boxes[key]
            if not _inside(op.index, b):
                continue
            lead = tuple(i - a for i, (a, _) in zip(op.index, b))  # the op's place in this shard
            off = (cut[0] if cut else 0,) + (0,) * (len(b) - k - 1)  # the piece's origin in the leaf's dims >= k
            piece = piece[tuple(slice(a - o, z - o) for (a, z), o in zip(b[k:], off))]
            assert piece.shape == shapes[key][k:], (group.leaves[key], op.index, piece.shape, shapes[key])
            if on_host:
                host[key][lead] = piece  # casts to the declared dtype
                continue
            part = np.empty((1,) * k + piece.shape, leaves[key].dtype)
            part[...] = piece
            start = np.asarray(lead, np.int32)
            dev[key] = [_write(buf, jax.device_put(part, d), start) for buf, d in zip(dev[key], devices)]
        jax.block_until_ready(list(dev.values()))  # one op's pieces in flight at a time
    if on_host:
        return {key: [jax.device_put(a, d) for d in devices] for key, a in host.items()}
    return dev


@functools.cache
def _zeros_on(shape: tuple[int, ...], dtype: str, device: Any) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=jax.sharding.SingleDeviceSharding(device))


def _zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> jax.Array:
    """Zeros made on `device` itself (`jnp.zeros(..., device=)` makes them elsewhere first, then copies)."""
    return _zeros_on(shape, np.dtype(dtype).name, device)()


@functools.partial(jax.jit, donate_argnums=0)
def _write(shard: jax.Array, piece: jax.Array, start: jax.Array) -> jax.Array:
    """`shard` with `piece` written at `start` (its leading dims), in place (donated). Bits are moved as
    unsigned integers of the same width: XLA:CPU widens bfloat16 / float8 to float32 for a dynamic-update-slice,
    which rewrites the whole shard per piece."""
    u = _UINT[shard.dtype.itemsize]
    at = [start[i] for i in range(start.shape[0])] + [0] * (shard.ndim - start.shape[0])
    out = jax.lax.dynamic_update_slice(jax.lax.bitcast_convert_type(shard, u), jax.lax.bitcast_convert_type(piece, u),
                                       at)
    return jax.lax.bitcast_convert_type(out, shard.dtype)


