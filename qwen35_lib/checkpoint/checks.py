"""The checks before any byte is read: every tensor the groups read is there, of the shape config.json implies,
of the weight's kind of number, FP8 with its scales; nothing left over (the vision tower and the MTP head are
skipped with one warning); the float-to-float casts said in one logged line."""

from __future__ import annotations

import collections
import logging
import pathlib
import warnings

import jax.numpy as jnp
import numpy as np

from qwen35_lib import safetensors_io
from qwen35_lib.checkpoint.files import FP8, CheckpointError, scale_name
from qwen35_lib.checkpoint.names import SKIPPED_PREFIXES, Group, Path
from qwen35_lib.config import Config
from qwen35_lib.weights import ArrayInfo

log = logging.getLogger("qwen35_lib.checkpoint")


def check(root: pathlib.Path, c: Config, tensors: dict, groups: list[Group], block: int | None,
           infos: dict[Path, ArrayInfo], mtp_prefix: str | None = None) -> None:
    """Raise on missing tensors, shapes that disagree with config.json, stored dtypes of another kind than the
    declared leaves (integers for floats), FP8 tensors without (right) scales and leftover tensors; warn once
    about skipped vision / MTP tensors; note once the float-to-float casts the copy will do. For the MTP head
    (`mtp_prefix` given), leftovers are its own unread tensors only, and nothing is said of the rest."""
    used, missing, wrong, fp8_wrong, kinds, casts = _scan(tensors, groups, block, infos)
    where = f"{root} (model_type {c.model_type}, {c.num_layers} layers, {c.num_experts} experts)"
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} tensors that config.json implies are missing: "
                              f"{some(missing)}. Check that every shard downloaded and that config.json belongs to "
                              "these weights")
    if kinds:
        raise CheckpointError(f"{where}: {len(kinds)} tensors hold another kind of number than their weight: "
                              f"{some(kinds, 3)}. A cast would make them garbage: use a checkpoint with float "
                              "weights (export it again)")
    if wrong:
        raise CheckpointError(f"{where}: {len(wrong)} tensors disagree with config.json: {some(wrong)}. "
                              "The config.json does not describe these weights: use the checkpoint's own config.json")
    if fp8_wrong:
        raise CheckpointError(f"{where}: {some(fp8_wrong)}")
    rest = [n for n in tensors if n not in used]
    if mtp_prefix is not None:  # the MTP head: its own tensors only, the rest of the checkpoint is the main model's
        left = [n for n in rest if n.startswith(mtp_prefix)]
        if left:
            raise CheckpointError(f"{where}: {len(left)} MTP tensors are not weights of a one-layer MTP head: "
                                  f"{some(left)}. This loader reads {mtp_prefix}layers.0 only (every published "
                                  "Qwen3.5 / Qwen3-Next head has one layer)")
    else:
        skipped = [n for n in rest if n.startswith(SKIPPED_PREFIXES)]
        left = [n for n in rest if not n.startswith(SKIPPED_PREFIXES)]
        if left:
            raise CheckpointError(f"{where}: {len(left)} tensors are neither weights of this text model nor vision "
                                  f"(model.visual.*) / MTP (mtp.*) weights: {some(left)}. Is config.json the right "
                                  "one?")
        if skipped:
            warnings.warn(f"{root}: skipped {len(skipped)} vision (model.visual.*) and MTP (mtp.*) tensors; this "
                          "loads the text model only (its MTP head loads apart: checkpoint.load_mtp)", stacklevel=4)
    if casts:
        log.warning("note: %s: %d tensors are cast to their weights' dtype (%s)", root, sum(casts.values()),
                    ", ".join(f"{n} x {k}" for k, n in sorted(casts.items())))


def _scan(tensors: dict, groups: list[Group], block: int | None, infos: dict[Path, ArrayInfo]) -> tuple:
    """Every source the groups read, against the files: (used names, missing, misshapen, FP8 problems, stored as
    another kind of number, {"stored -> leaf dtype": count} of the float casts)."""
    used: set[str] = set()
    missing: list[str] = []
    wrong: list[str] = []
    fp8_wrong: list[str] = []
    kinds: list[str] = []
    casts: collections.Counter[str] = collections.Counter()
    for grp in groups:
        leaf_dtypes = {np.dtype(infos[p].dtype) for p in grp.leaves.values()}
        leaf_kinds = {_kind(d) for d in leaf_dtypes}
        for op in grp.ops:
            for name, shape in zip(op.sources, op.shapes, strict=True):
                used.add(name)
                if name not in tensors:
                    missing.append(name)
                    continue
                info = tensors[name].tensors[name]
                if safetensors_io.kind(info.dtype) not in leaf_kinds:
                    kinds.append(f"{name} is stored as {info.dtype} ({safetensors_io.kind(info.dtype)}s), but its "
                                 f"weight is {' / '.join(sorted(d.name for d in leaf_dtypes))}")
                    continue
                target = _cast_target(name, info.dtype, op.raw, leaf_dtypes)
                if target is not None and safetensors_io.DTYPES[info.dtype] != target:
                    casts[f"{info.dtype} -> {target.name}"] += 1
                if info.shape != shape:
                    wrong.append(f"{name}: config.json implies {shape}, the file has {info.shape}")
                _check_fp8(name, info, shape, op.raw, block, tensors, used, missing, wrong, fp8_wrong)
    return used, missing, wrong, fp8_wrong, kinds, casts


def _check_fp8(name: str, info: safetensors_io.TensorInfo, shape: tuple[int, ...], raw: bool, block: int | None,
               tensors: dict, used: set[str], missing: list[str], wrong: list[str], fp8_wrong: list[str]) -> None:
    """FP8 sources: kept ones (`raw`) must be F8_E4M3; dequantized ones need their `scale_inv`, of the right shape."""
    if raw and not name.endswith("_scale_inv") and info.dtype != "F8_E4M3":
        fp8_wrong.append(f"{name} is {info.dtype}, not F8_E4M3 (expert_dtype float8_e4m3fn keeps FP8 experts)")
    if not raw and info.dtype == "F8_E4M3":  # dequantized on read: its scale must be there and fit
        scale = scale_name(name)
        used.add(scale)
        if block is None:
            fp8_wrong.append(f"{name} is FP8 but config.json has no quantization_config.weight_block_size")
        elif scale not in tensors:
            missing.append(scale)
        else:
            want = (*shape[:-2], *(-(-n // block) for n in shape[-2:]))
            sinfo = tensors[scale].tensors[scale]
            if sinfo.shape != want:
                wrong.append(f"{scale}: blocks of {block} imply {want}, the file has {sinfo.shape}")
            if safetensors_io.kind(sinfo.dtype) != "float":
                fp8_wrong.append(f"{scale} is stored as {sinfo.dtype}; FP8 scales are floats")


def _cast_target(name: str, stored: str, raw: bool, leaf_dtypes: set[np.dtype]) -> np.dtype | None:
    """The dtype a stored tensor is cast to on copy; None when it is dequantized (FP8 read as weights) or when
    its group's leaves differ in dtype (then `split` decides)."""
    if raw:  # FP8 kept: values into the float8 leaf, scales into the float32 one
        return np.dtype(np.float32) if name.endswith("_scale_inv") else FP8
    if stored == "F8_E4M3" or len(leaf_dtypes) > 1:
        return None
    return next(iter(leaf_dtypes))


def _kind(dt: np.dtype) -> str:
    return "float" if jnp.issubdtype(dt, jnp.floating) else "bool" if dt == np.bool_ else "int"


def some(items: list[str], n: int = 10) -> str:
    """The first `n` items, each printable and short (tensor names come from file headers: newlines, megabytes)."""
    shown = [i if i.isprintable() and len(i) <= 200 else safetensors_io.quote(i, 200) for i in items[:n]]
    return ", ".join(shown) + (f" ... and {len(items) - n} more" if len(items) > n else "")

