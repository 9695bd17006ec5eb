"""Load HuggingFace safetensors checkpoints of Qwen3.5 MoE and Qwen3-Next into our weight tree.

Public: `load_hf_checkpoint(path, ...) -> (Config, weights)`. The tree is exactly `declare(config)`'s, filled.
`load_mtp(path, ...) -> (Config, mtp_weights)`: the multi-token-prediction head (`mtp.*`), a tree of its own
(`model.mtp.declare_mtp(config)`), read by the same plan, checks and readers (opt-in: the main load skips it).

On-disk forms read (HF name -> our leaf; HF `nn.Linear` weights are [out, in], ours [in, ..., out]):
- prefix `model.` (text checkpoints) or `model.language_model.` (the Qwen3.5 VL checkpoints); `model.visual.*`
  and `mtp.*` are skipped by `load_hf_checkpoint` with one warning;
- experts fused (`mlp.experts.gate_up_proj [E, 2F, D]`, `mlp.experts.down_proj [E, D, F]`) or per expert
  (`mlp.experts.{e}.{gate,up,down}_proj.weight`) -> `w_gate_up [E, D, 2, F]`, `w_down [E, F, D]`;
- GDN: Qwen3.5 `in_proj_qkv` ([q | k | v] rows, head-major), `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next
  `in_proj_qkvz` / `in_proj_ba`, grouped by key head (`fix_query_key_value_ordering`); `conv1d.weight
  [conv_dim, 1, K]` -> `conv_q/k/v [K, heads, head_dim]` (tap K-1 multiplies the current token);
- attention `q_proj [Hq * 2 * hd, D]` is per head [query hd | gate hd] -> `w_q`, `w_gate [D, Hq, hd]`;
- block-scaled FP8: `X.weight` (float8_e4m3fn) with `X.weight_scale_inv [cdiv(out, b), cdiv(in, b)]` (fused:
  `X_scale_inv`), `w = q * scale_inv` blockwise. Dequantized, or experts kept as `BlockFP8` (`fp8="keep"`).

Without a mesh, every HF tensor is fetched once (`safetensors_io.SafeTensorsFile.get`, a memmap view) and its bytes
copied once: leaves that share a source (e.g. `w_q`, `w_k`, `w_v` from `in_proj_qkv`) are assembled together as one
group. With a mesh, each device's shard is read straight from the files, slice by slice (`_load_sliced`): a tensor
is fetched once per distinct shard that needs it, and the host never holds a whole leaf.

What is refused (one-line errors: `CheckpointError`, `ConfigError`, `SafeTensorsError`, all `ValueError`s):
files outside the folder (an index entry that is not a plain file name), files that are not regular (a FIFO),
safetensors files that break the format, a stored dtype of another kind than the declared weight (integers for
a float), non-finite weights (checked on the device that holds each shard; `check_weights=False` skips it),
EOS ids of generation_config.json that are not token ids of the vocabulary. Float-to-float casts (e.g. BF16
stored, float32 declared) are allowed and said in one logged line per load.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import pathlib
import stat
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib import safetensors_io
from qwen35_lib.config import FULL, LINEAR, Config, ConfigError, eos_ids, from_hf_config, read_json
from qwen35_lib.weights import ArrayInfo, BlockFP8, declare, dequantize_fp8_np, is_info

Path = tuple[str, ...]  # a leaf's path in the weight tree, e.g. ("layers", "gdn", "w_q")
Place = Callable[[Path, np.ndarray, ArrayInfo], Any]
MTP_PREFIXES = ("mtp.", "model.mtp.")  # the multi-token-prediction head: `load_mtp` reads it
SKIPPED_PREFIXES = ("model.visual.", "visual.", *MTP_PREFIXES)  # what `load_hf_checkpoint` skips: vision tower, MTP
FP8 = np.dtype(jnp.float8_e4m3fn)
INDEX = "model.safetensors.index.json"
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint folder whose files do not make this model's weights (one line: what is wrong, the fix)."""


def default_place(path: Path, array: np.ndarray, info: ArrayInfo) -> jax.Array:
    """Put a loaded leaf on the default device (a sharded loader passes its own `place`)."""
    return jnp.asarray(array)


def sharded_place(config: Config, plan, mesh) -> Place:
    """A `place` that cuts each whole host leaf into its shards under the serving `plan` on `mesh`
    (`make_array_from_callback`): no device holds a whole leaf, but the host does, one at a time. The reference
    twin of the sliced load (`load_hf_checkpoint(..., mesh=)`), which never builds a whole leaf."""
    from jax.sharding import NamedSharding

    from qwen35_lib.parallel.layouts import spec

    layout = plan.bound(mesh, config)

    def place(path: Path, array: np.ndarray, info: ArrayInfo) -> jax.Array:
        sharding = NamedSharding(mesh, spec(layout, mesh, info.logical_axes, info.shape))
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    return place


def load_hf_checkpoint(path: str | pathlib.Path, *, dtype: Any = None, fp8: str = "dequantize",
                       place: Place | None = None, mesh=None, layout: Any = None, check_weights: bool = True,
                       progress: bool | None = None, **config_changes: Any) -> tuple[Config, dict]:
    """Read an HF checkpoint directory (`config.json` + `*.safetensors`) into `(config, weights)`.

    dtype: the weights' dtype ("float32" / "bfloat16"); default: the checkpoint's (config.json `dtype`).
    fp8: "dequantize" (FP8 tensors become plain weights in `dtype`) or "keep" (FP8 expert weights stay
      `BlockFP8(value, scale)` and the config gets `expert_dtype="float8_e4m3fn"`; the rest is dequantized).
    place: `(path, numpy leaf, ArrayInfo) -> jax.Array`, called once per whole leaf as soon as it is assembled on
      the host; default: the default device.
    mesh, layout: load for a serving plan (a `ServingPlan`, or a layout name, e.g. "dp8_ep8") on a `('chip',
      'core')` mesh, sliced (the plan bound to the mesh and checked against the model once): each
      device's shard of every leaf is read from the memory-mapped files, piece by piece (`_load_sliced`), so the
      host never holds a whole leaf: beyond the weights on the devices, one op's piece for one device (e.g. one
      expert's tensors), or small shards of at most that many bytes together. A tqdm bar shows the reads.
    check_weights: refuse NaN / Inf weights (a jitted `isfinite` reduction per placed leaf, on its devices: no
      host scan); False skips it.
    progress: a tqdm bar on stderr over the tensors read and their bytes; None (default): only on a terminal.
    config_changes: fields of `Config` to override (e.g. `gdn_state_dtype="bfloat16"`).

    1. Find the safetensors files (`model.safetensors.index.json`, else every `*.safetensors`); build the Config
       (EOS ids from `generation_config.json` when present).
    2. Plan: for every group of leaves, the HF tensors it needs, their expected shapes, and how they split.
    3. Check before reading: missing tensors, shapes that disagree with config.json, stored dtypes of the wrong
       kind, leftover tensors.
    4. With a mesh, every device's shards read slice by slice (`_load_sliced`); else per group: allocate the numpy
       leaves, copy every source in (each read once) and `place` each leaf (`_load_whole`).
    5. Check every leaf against `declare(config)`; start its finiteness check.
    6. Wait for the finiteness checks; name the HF tensors of any leaf that failed.
    """
    ck = _open_checkpoint(path, dtype, fp8, place, mesh, layout, config_changes)
    groups = _plan(ck.config, ck.prefix, ck.tensors, ck.tied)
    return ck.config, _load_tree(ck, declare(ck.config), groups, place, mesh, check_weights, progress)


def load_mtp(path: str | pathlib.Path, *, dtype: Any = None, fp8: str = "dequantize", place: Place | None = None,
             mesh=None, layout: Any = None, check_weights: bool = True, progress: bool | None = None,
             **config_changes: Any) -> tuple[Config, dict]:
    """Read the multi-token-prediction head (`mtp.*`) of an HF checkpoint directory into `(config, mtp_weights)`.

    `config` is the one `load_hf_checkpoint` gives for the same arguments; `mtp_weights` is a tree of its own,
    `model.mtp.declare_mtp(config)`'s, never part of the main model's weights (the head runs with
    `model.mtp.mtp_forward`, which reads the main model's embedding and LM head). The arguments are
    `load_hf_checkpoint`'s, and so are the forms read: the head's experts fused or per expert (independently of the
    main layers': the Qwen3.5 checkpoints store the main experts fused and the head's per expert), block-scaled FP8
    (dequantized, or its experts kept with fp8="keep" where the main experts are FP8), sliced per device with `mesh`.

    HF names (prefix `mtp.`): `pre_fc_norm_embedding.weight`, `pre_fc_norm_hidden.weight` [D], `fc.weight` [D, 2D]
    (input: cat([embedding, hidden])), `layers.0.*` (a full-attention decoder layer, named as the main layers),
    `norm.weight` [D]. The checks are the main load's, on the head's tensors: missing, misshapen, of another kind,
    non-finite; `mtp.*` tensors left over (a second head layer) are refused, the rest of the checkpoint is not read.
    """
    ck = _open_checkpoint(path, dtype, fp8, place, mesh, layout, config_changes)
    from qwen35_lib.model.mtp import declare_mtp

    prefix = next((p for p in MTP_PREFIXES if any(n.startswith(p) for n in ck.tensors)), None)
    if prefix is None:
        raise CheckpointError(f"{ck.root}: no multi-token-prediction head (no mtp.* tensors); load a checkpoint that "
                              "ships one (the published Qwen3.5 / Qwen3-Next ones do), or serve without MTP")
    groups = _plan_mtp(ck.config, prefix, ck.tensors)
    return ck.config, _load_tree(ck, declare_mtp(ck.config), groups, place, mesh, check_weights, progress,
                                 mtp_prefix=prefix)


@dataclasses.dataclass(frozen=True)
class _Checkpoint:
    root: pathlib.Path
    config: Config
    tensors: dict  # tensor name -> its open file
    prefix: str  # "model." or "model.language_model."
    quant: int | None  # the FP8 block size; None: unquantized
    tied: bool
    plan: Any  # the serving plan of a sliced load (None without a mesh)


def _open_checkpoint(path: str | pathlib.Path, dtype: Any, fp8: str, place: Place | None, mesh, layout: Any,
                     config_changes: dict) -> _Checkpoint:
    """`load_hf_checkpoint`'s step 1: the files, the Config, the FP8 block and the plan of a sliced load."""
    if fp8 not in ("dequantize", "keep"):
        raise ValueError(f"fp8={fp8!r}; use 'dequantize' (plain weights) or 'keep' (BlockFP8 experts)")
    root = pathlib.Path(path)
    config_path = root / "config.json"
    if not os.path.lexists(config_path):
        raise FileNotFoundError(f"no config.json in {root}; pass an HF checkpoint directory "
                                "(config.json + *.safetensors)")
    hf = read_json(config_path, "config.json")
    base = from_hf_config(hf, source=str(config_path))  # fails early on a broken config.json
    quant = _quant_block(hf, config_path)
    tensors = _open_files(root)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in tensors) else "model."
    changes = _config_changes(root, hf, tensors, prefix, quant, dtype, fp8, config_changes,
                              config_changes.get("vocab_size", base.vocab_size))
    config = from_hf_config(hf, source=str(config_path), **changes)
    plan = None
    if mesh is not None:
        from qwen35_lib.plan import SINGLE, get_layout

        plan = get_layout(layout) if isinstance(layout, str) else layout if layout is not None else SINGLE
    if place is not None and mesh is not None:
        raise ValueError("pass either place or mesh (mesh places each leaf into its shards for the layout)")
    if config.expert_dtype is not None and config.fp8_block_size != quant:
        raise ValueError(f"{root}: expert_dtype={config.expert_dtype!r} keeps the checkpoint's FP8 experts, but the "
                         f"checkpoint has {'no FP8 weights' if not quant else f'FP8 blocks of {quant}'}; "
                         "load with fp8='keep' on an FP8 checkpoint, or without expert_dtype")
    text = hf.get("text_config") or hf
    tied = text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    if not isinstance(tied, bool):
        raise ConfigError(f"{config_path}: tie_word_embeddings is {tied!r}; it must be true or false")
    return _Checkpoint(root, config, tensors, prefix, quant, tied, plan)


def _load_tree(ck: _Checkpoint, decl: Any, groups: list[_Group], place: Place | None, mesh, check_weights: bool,
               progress: bool | None, mtp_prefix: str | None = None) -> Any:
    """`load_hf_checkpoint`'s steps 3-6 for the tree `decl` filled by `groups` (the main model's, or the MTP head's
    when `mtp_prefix` names its tensors): check, read, check every leaf, wait for the finiteness checks."""
    root, config, tensors = ck.root, ck.config, ck.tensors
    infos = dict(path_infos(decl))
    _check(root, config, tensors, groups, ck.quant, infos, mtp_prefix)
    bar = _Progress(progress, root.name if mtp_prefix is None else f"{root.name} (MTP head)")
    try:
        if mesh is not None:
            out = _load_sliced(groups, infos, tensors, ck.quant, _shardings(config, ck.plan, mesh, infos), bar)
        else:
            out = _load_whole(groups, infos, tensors, ck.quant, place or default_place, bar)
    finally:
        bar.close()
    finite: list[tuple[Path, Any]] = []  # (leaf, its on-device all-finite flag), resolved after the last leaf
    for p, leaf in out.items():
        if (leaf.shape, leaf.dtype) != (infos[p].shape, infos[p].dtype):
            raise ValueError(f"place returned {leaf.shape} {leaf.dtype} for {'/'.join(p)}, declared "
                             f"{infos[p].shape} {infos[p].dtype}; place must keep the shape and dtype")
        if check_weights and jnp.issubdtype(leaf.dtype, jnp.inexact):
            finite.append((p, _all_finite(leaf)))  # dispatched, not awaited
    assert out.keys() == infos.keys(), f"internal error: no plan for {sorted(set(infos) - set(out))}"
    bad = [p for (p, _), ok in zip(finite, jax.device_get([f for _, f in finite]), strict=True) if not ok]
    if bad:
        names = list(dict.fromkeys(n for p in bad for n in _nonfinite_sources(p, out[p], groups, tensors)))
        raise CheckpointError(f"{root}: {len(names)} tensors hold NaN or Inf values: {_some(names)} (leaves "
                              f"{', '.join('/'.join(p) for p in bad[:5])}); the checkpoint is corrupt: download it "
                              "again, or pass check_weights=False (CLI: --no-check-weights) to load it anyway")
    return jax.tree.structure(decl, is_leaf=is_info).unflatten([out[p] for p in infos])


def _load_whole(groups: list[_Group], infos: dict[Path, ArrayInfo], tensors: dict, block: int | None, place: Place,
                bar: _Progress) -> dict[Path, Any]:
    """Per group: allocate the whole numpy leaves, copy every source in (each read once), `place` each leaf."""
    bar.start(sum(len(g.ops) for g in groups), sum(_op_bytes(op, None, tensors) for g in groups for op in g.ops))
    out: dict[Path, Any] = {}
    for group in groups:
        arrays = {key: np.empty(infos[p].shape, infos[p].dtype) for key, p in group.leaves.items()}
        for op in group.ops:
            sources = [_read(tensors, n, block, op.raw) for n in op.sources]
            for key, piece in op.split(*sources).items():
                target = arrays[key][op.index]
                assert piece.shape == target.shape, (group.leaves[key], op.index, piece.shape, target.shape)
                target[...] = piece  # casts to the declared dtype
            bar.update(1, _op_bytes(op, None, tensors))
        for key, p in group.leaves.items():
            out[p] = place(p, arrays.pop(key), infos[p])
    return out


def _shardings(config: Config, plan, mesh, infos: dict[Path, ArrayInfo]) -> dict[Path, Any]:
    from jax.sharding import NamedSharding

    from qwen35_lib.parallel.layouts import spec

    layout = plan.bound(mesh, config)
    return {p: NamedSharding(mesh, spec(layout, mesh, i.logical_axes, i.shape)) for p, i in infos.items()}


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    """A scalar: no NaN or Inf in `x`; each device reduces its own shards, then one small all-reduce."""
    return jnp.all(jnp.isfinite(x))


def _nonfinite_sources(path: Path, leaf: jax.Array, groups: list[_Group], tensors: dict) -> list[str]:
    """The HF tensors behind the non-finite parts of `leaf` (only called when there are some).

    1. On the device: one reduction over the dims below the ops' index (e.g. [G, P] for a per-layer leaf,
       [G, P, E] for per-expert tensors): the ops whose part of the leaf is bad.
    2. On the host, those ops' sources only (and their FP8 scales): the ones holding NaN / Inf. None: the values
       overflowed in the cast to the leaf's dtype.
    """
    ops = [op for g in groups if path in g.leaves.values() for op in g.ops]
    k = max(len(op.index) for op in ops)
    bad = np.asarray(jnp.any(~jnp.isfinite(leaf), axis=tuple(range(k, leaf.ndim))))
    names = []
    for op in (op for op in ops if bad[op.index].any()):
        stored = [*op.sources, *(_scale_name(n) for n in op.sources if not op.raw and tensors[n].tensors[n].dtype
                                 == "F8_E4M3")]
        culprits = [n for n in stored if not np.isfinite(tensors[n].get(n)).all()]
        names += culprits or [f"{n} (overflows {leaf.dtype})" for n in op.sources]
    return list(dict.fromkeys(names))


def _config_changes(root: pathlib.Path, hf: dict, tensors: dict, prefix: str, quant: int | None, dtype: Any,
                    fp8: str, changes: dict, vocab_size: int) -> dict:
    """Config fields set by the load: the name (the directory's, unless config.json has one), `dtype`, EOS ids
    from generation_config.json, FP8 experts kept."""
    changes = dict(changes)
    if not (hf.get("_name_or_path") or (hf.get("text_config") or {}).get("_name_or_path")):
        changes.setdefault("name", root.resolve().name)
    if dtype is not None:
        changes["dtype"] = jnp.dtype(dtype).name
    gen = root / "generation_config.json"
    if os.path.lexists(gen) and "eos_token_ids" not in changes:  # what HF generate() stops on
        g = read_json(gen, "generation_config.json")
        if not isinstance(g, dict):
            raise ConfigError(f"{gen}: holds a JSON {type(g).__name__}, not an object; use the checkpoint's own "
                              "generation_config.json (or delete it: EOS ids then come from config.json)")
        if g.get("eos_token_id") is not None:
            changes["eos_token_ids"] = eos_ids(g["eos_token_id"], vocab_size, f"{gen}: eos_token_id")
    if fp8 == "keep" and quant and _experts_are_fp8(tensors, prefix):
        changes.setdefault("expert_dtype", "float8_e4m3fn")
    return changes


# ---------------------------------------------------------------------------------------------------------------
# Files, config and reading


def _open_files(root: pathlib.Path) -> dict[str, safetensors_io.SafeTensorsFile]:
    """Tensor name -> its open file, over the files the index names, else every `*.safetensors` in `root`.

    Index entries must be plain file names in `root` (no directories, no `..`, not absolute) naming regular
    files; symlinks are followed (the Hugging Face cache links each file to a blob elsewhere).
    """
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; pass the checkpoint directory "
                                "(config.json + *.safetensors)")
    index = root / INDEX
    if os.path.lexists(index):
        names = _index_files(index)
        absent = [n for n in names if not (root / n).exists()]
        if absent:
            raise FileNotFoundError(f"{index.name} names {len(absent)} files missing from {root}: {absent[:10]}; "
                                    "finish the download")
    else:
        names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors files in {root}; this loader reads safetensors only (no .bin / "
                                ".pt pickles): download the safetensors weights or convert them first")
    for n in names:
        mode = os.stat(root / n).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise CheckpointError(f"{root / n}: {kind}; a checkpoint's weights are regular files (or symlinks to them)")
    tensors: dict[str, safetensors_io.SafeTensorsFile] = {}
    for f in (safetensors_io.SafeTensorsFile(root / n) for n in names):
        for name in f.keys():
            if name in tensors:
                raise CheckpointError(f"tensor {safetensors_io.quote(name)} is in both {tensors[name].path} and "
                                      f"{f.path}; remove the stray file")
            tensors[name] = f
    return tensors


def _index_files(index: pathlib.Path) -> list[str]:
    """The file names an index's `weight_map` {tensor: file} names, each a plain name of a file in its folder."""
    data = read_json(index, INDEX)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no weight_map object (tensor name -> file name); download the index again, "
                              "or delete it to read every *.safetensors file in the folder")
    names = set()
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: weight_map[{safetensors_io.quote(tensor)}] is not a file name; download "
                                  "the index again")
        if file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file:
            raise CheckpointError(f"{index}: weight_map[{safetensors_io.quote(tensor)}] is "
                                  f"{safetensors_io.quote(file)}, not a plain file name in the checkpoint folder "
                                  "(no directories, '..' or absolute paths); download the index again")
        names.add(file)
    return sorted(names)


def _quant_block(hf: dict, where: pathlib.Path) -> int | None:
    """The FP8 block size of a block-scaled FP8 checkpoint, None for an unquantized one."""
    quant = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if not (isinstance(quant, dict) and quant.get("quant_method") == "fp8" and isinstance(block, list) and block
            and isinstance(block[0], int) and not isinstance(block[0], bool) and block[0] >= 1):
        raise ConfigError(f"{where}: quantization_config {safetensors_io.quote(quant)} is not supported; this loader "
                          "reads block-scaled FP8 (quant_method 'fp8' with weight_block_size) or unquantized "
                          "checkpoints")
    return block[0]


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def _experts_are_fp8(tensors: dict, prefix: str) -> bool:
    return any(n.startswith(prefix + "layers.") and ".mlp.experts." in n and f.tensors[n].dtype == "F8_E4M3"
               for n, f in tensors.items())


def _read(tensors: dict, name: str, block: int | None, raw: bool, rows: tuple[int, int] | None = None) -> np.ndarray:
    """A tensor as stored (`raw`, or not FP8), or dequantized to float32 with its `scale_inv`; with `rows`
    (start, stop), only those rows of dim 0 (and of the scale's dim 0: fused experts, one scale row per expert)."""
    value = tensors[name].get(name)
    cut = slice(None) if rows is None else slice(*rows)
    if raw or value.dtype != FP8:
        return value[cut]
    scale_name = _scale_name(name)
    return dequantize_fp8_np(value[cut], tensors[scale_name].get(scale_name)[cut], block)


# ---------------------------------------------------------------------------------------------------------------
# The plan: groups of leaves filled by ops, each op reading some HF tensors once


@dataclasses.dataclass(frozen=True)
class _Op:
    sources: tuple[str, ...]  # HF tensor names, passed to `split` in this order
    shapes: tuple[tuple[int, ...], ...]  # their shapes as config.json implies
    index: tuple[int, ...]  # where the pieces go in each leaf of the group (leading dims)
    split: Callable[..., dict[str, np.ndarray]]  # source arrays -> {leaf key: piece}
    raw: bool = False  # True: FP8 sources as stored (values and scales), not dequantized
    experts: bool = False  # True: every source's dim 0 is the leaves' dim len(index) (fused experts [E, ...])


@dataclasses.dataclass
class _Group:
    leaves: dict[str, Path]  # leaf key (as `split` names it) -> path in the tree
    ops: list[_Op] = dataclasses.field(default_factory=list)


class _Planner:
    """Collects ops into groups: `add` for an op filling several leaves, `one` for a single tensor -> leaf."""

    def __init__(self):
        self.groups: dict[tuple[Path, ...], _Group] = {}

    def add(self, leaves: dict[str, Path], sources: list[tuple[str, tuple[int, ...]]], index: tuple[int, ...],
            split: Callable[..., dict[str, np.ndarray]], raw: bool = False, experts: bool = False) -> None:
        group = self.groups.setdefault(tuple(leaves.values()), _Group(leaves))
        group.ops.append(_Op(tuple(n for n, _ in sources), tuple(s for _, s in sources), index, split, raw, experts))

    def one(self, path: Path, name: str, shape: tuple[int, ...], index: tuple[int, ...] = (),
            fn: Callable[[np.ndarray], np.ndarray] = lambda a: a) -> None:
        self.add({"x": path}, [(name, shape)], index, lambda a: {"x": fn(a)})


def _in_heads(w: np.ndarray, n: int, d: int) -> np.ndarray:
    """HF rows [n * d, X] (head-major) -> ours [X, n, d]."""
    return w.reshape(n, d, w.shape[-1]).transpose(2, 0, 1)


def _out_heads(w: np.ndarray, n: int, d: int) -> np.ndarray:
    """HF [D, n * d] (an output projection) -> ours [n, d, D]."""
    return w.reshape(w.shape[0], n, d).transpose(1, 2, 0)


def _plan(c: Config, prefix: str, tensors: dict, tied: bool) -> list[_Group]:
    """Every group of leaves and the ops that fill it.

    1. Top level: embed, final_norm, lm_head (`lm_head.weight`, else the embedding if `tied`).
    2. Per layer i (group g = i // P, slot p = i % P, slot j among layers of its kind): norms and MoE at
       [g, p], then the GDN or attention block at [g, j].
    """
    pl = _Planner()
    D, V = c.hidden_size, c.vocab_size
    embed = prefix + "embed_tokens.weight"
    if "lm_head.weight" in tensors or not tied:
        pl.one(("embed",), embed, (V, D))
        pl.one(("lm_head",), "lm_head.weight", (V, D), fn=lambda a: a.T)
    else:  # tied: one read feeds both leaves
        pl.add({"embed": ("embed",), "lm_head": ("lm_head",)}, [(embed, (V, D))], (),
               lambda a: {"embed": a, "lm_head": a.T})
    pl.one(("final_norm",), prefix + "norm.weight", (D,))
    for i in range(c.num_layers):
        _plan_layer(pl, c, f"{prefix}layers.{i}.", i, tensors)
    return list(pl.groups.values())


def _plan_layer(pl: _Planner, c: Config, pre: str, i: int, tensors: dict) -> None:
    """Decoder layer i of `c` (HF names under `pre`, e.g. "model.layers.3."), into the `layers` leaves: norms and
    MoE at [g, p], the GDN or attention block at [g, j] (g = i // P, p = i % P, j = its index among the layers of
    its kind in the group). The experts' form (fused or per expert) is read per layer."""
    D = c.hidden_size
    kind = c.layer_types[i]
    g, p = divmod(i, len(c.layer_pattern))
    j = c.layer_pattern[:p].count(kind)
    pl.one(("layers", "input_norm"), pre + "input_layernorm.weight", (D,), (g, p))
    pl.one(("layers", "post_norm"), pre + "post_attention_layernorm.weight", (D,), (g, p))
    _plan_moe(pl, c, pre + "mlp.", (g, p), fused=pre + "mlp.experts.gate_up_proj" in tensors)
    if kind == LINEAR:
        _plan_gdn(pl, c, pre + "linear_attn.", (g, j))
    else:
        assert kind == FULL, kind
        _plan_attn(pl, c, pre + "self_attn.", (g, j))


def _plan_mtp(c: Config, prefix: str, tensors: dict) -> list[_Group]:
    """Every group of the MTP head's leaves (`model.mtp.declare_mtp`) and the ops that fill it: its norms, `fc`
    (HF [D, 2D] on cat([embedding, hidden]) -> ours [2, D, D]: fc[0] the embedding half, fc[1] the hidden half) and
    its one decoder layer, planned as layer 0 of a one-layer model (`mtp_layer_config`)."""
    from qwen35_lib.model.mtp import mtp_layer_config

    pl = _Planner()
    D = c.hidden_size
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        pl.one((name,), f"{prefix}{name}.weight", (D,))
    pl.one(("fc",), prefix + "fc.weight", (D, 2 * D), fn=lambda a: a.T.reshape(2, D, D))
    _plan_layer(pl, mtp_layer_config(c), prefix + "layers.0.", 0, tensors)
    return list(pl.groups.values())


def _plan_gdn(pl: _Planner, c: Config, la: str, gj: tuple[int, int]) -> None:
    """One Gated DeltaNet layer (`la` = "...linear_attn.")."""
    D, K = c.hidden_size, c.gdn_conv_kernel
    nk, nv, dk, dv, kd, vd = c.gdn_num_k_heads, c.gdn_num_v_heads, c.gdn_k_head_dim, c.gdn_v_head_dim, \
        c.gdn_key_dim, c.gdn_value_dim
    r = nv // nk  # value heads per key head
    gdn = ("layers", "gdn")
    proj = {n: (*gdn, n) for n in ("w_q", "w_k", "w_v", "w_z", "w_b", "w_a")}
    if c.model_type == "qwen3_next":
        def split_next(qkvz: np.ndarray, ba: np.ndarray) -> dict[str, np.ndarray]:
            # rows grouped by key head: per group [q dk | k dk | v r*dv | z r*dv] and [b r | a r];
            # group h owns value heads h*r .. h*r + r-1, so value rows are head-major after the split
            q, k, v, z = np.split(qkvz.reshape(nk, 2 * dk + 2 * r * dv, D), [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            b, a = np.split(ba.reshape(nk, 2 * r, D), [r], axis=1)
            return dict(w_q=q.transpose(2, 0, 1), w_k=k.transpose(2, 0, 1),  # [D, nk, dk]
                        w_v=_in_heads(v, nv, dv), w_z=_in_heads(z, nv, dv),  # [D, nv, dv]
                        w_b=b.reshape(nv, D).T, w_a=a.reshape(nv, D).T)  # [D, nv]

        pl.add(proj, [(la + "in_proj_qkvz.weight", (2 * kd + 2 * vd, D)), (la + "in_proj_ba.weight", (2 * nv, D))],
               gj, split_next)
    else:
        def split_qkv(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray) -> dict[str, np.ndarray]:
            q, k, v = np.split(qkv, [kd, 2 * kd])  # rows [q | k | v], each head-major
            return dict(w_q=_in_heads(q, nk, dk), w_k=_in_heads(k, nk, dk), w_v=_in_heads(v, nv, dv),
                        w_z=_in_heads(z, nv, dv), w_b=b.T, w_a=a.T)

        pl.add(proj, [(la + "in_proj_qkv.weight", (2 * kd + vd, D)), (la + "in_proj_z.weight", (vd, D)),
                      (la + "in_proj_b.weight", (nv, D)), (la + "in_proj_a.weight", (nv, D))], gj, split_qkv)

    def split_conv(w: np.ndarray) -> dict[str, np.ndarray]:
        q, k, v = np.split(w[:, 0, :], [kd, 2 * kd])  # channels [q | k | v] (both model types), each [ch, K]
        return dict(conv_q=_in_heads(q, nk, dk), conv_k=_in_heads(k, nk, dk), conv_v=_in_heads(v, nv, dv))  # [K, n, d]

    pl.add({n: (*gdn, n) for n in ("conv_q", "conv_k", "conv_v")}, [(la + "conv1d.weight", (2 * kd + vd, 1, K))],
           gj, split_conv)
    pl.one((*gdn, "A_log"), la + "A_log", (nv,), gj)
    pl.one((*gdn, "dt_bias"), la + "dt_bias", (nv,), gj)
    pl.one((*gdn, "norm"), la + "norm.weight", (dv,), gj)
    pl.one((*gdn, "w_out"), la + "out_proj.weight", (D, vd), gj, lambda a: _out_heads(a, nv, dv))


def _plan_attn(pl: _Planner, c: Config, sa: str, gj: tuple[int, int]) -> None:
    """One gated attention layer (`sa` = "...self_attn.")."""
    D, Hq, Hkv, hd = c.hidden_size, c.num_q_heads, c.num_kv_heads, c.head_dim
    attn = ("layers", "attn")

    def split_q(w: np.ndarray) -> dict[str, np.ndarray]:
        qg = w.reshape(Hq, 2, hd, D)  # per head [query hd | gate hd]
        return dict(w_q=qg[:, 0].transpose(2, 0, 1), w_gate=qg[:, 1].transpose(2, 0, 1))  # [D, Hq, hd]

    pl.add({"w_q": (*attn, "w_q"), "w_gate": (*attn, "w_gate")}, [(sa + "q_proj.weight", (Hq * 2 * hd, D))], gj,
           split_q)
    pl.one((*attn, "w_k"), sa + "k_proj.weight", (Hkv * hd, D), gj, lambda a: _in_heads(a, Hkv, hd))
    pl.one((*attn, "w_v"), sa + "v_proj.weight", (Hkv * hd, D), gj, lambda a: _in_heads(a, Hkv, hd))
    pl.one((*attn, "w_o"), sa + "o_proj.weight", (D, Hq * hd), gj, lambda a: _out_heads(a, Hq, hd))
    pl.one((*attn, "q_norm"), sa + "q_norm.weight", (hd,), gj)
    pl.one((*attn, "k_norm"), sa + "k_norm.weight", (hd,), gj)


def _plan_moe(pl: _Planner, c: Config, m: str, gp: tuple[int, int], fused: bool) -> None:
    """One MoE block (`m` = "...mlp."): router, shared expert, routed experts.

    Experts: `w_gate_up [E, D, 2, F]`, `w_down [E, F, D]`. Fused tensors give one op per layer, per-expert tensors
    one op per expert. With `config.expert_dtype` set, values and `scale_inv` tensors are copied as stored into
    `BlockFP8(value, scale)` leaves, the scales transposed like the values.
    """
    D, E, F, Fs, b = c.hidden_size, c.num_experts, c.moe_ffn, c.shared_ffn, c.fp8_block_size
    moe, s, x = ("layers", "moe"), m + "shared_expert.", m + "experts."
    pl.one((*moe, "router"), m + "gate.weight", (E, D), gp, lambda a: a.T)
    pl.one((*moe, "shared_gate"), m + "shared_expert_gate.weight", (1, D), gp, lambda a: a[0])
    pl.add({"x": (*moe, "shared_gate_up")}, [(s + "gate_proj.weight", (Fs, D)), (s + "up_proj.weight", (Fs, D))],
           gp, lambda gw, uw: {"x": np.stack([gw.T, uw.T], axis=1)})  # [D, 2, Fs]
    pl.one((*moe, "shared_down"), s + "down_proj.weight", (D, Fs), gp, lambda a: a.T)

    fp8 = c.expert_dtype is not None
    cd, cf = -(-D // b), -(-F // b)
    gu = {"v": (*moe, "w_gate_up", "value"), "s": (*moe, "w_gate_up", "scale")} if fp8 else {"v": (*moe, "w_gate_up")}
    dn = {"v": (*moe, "w_down", "value"), "s": (*moe, "w_down", "scale")} if fp8 else {"v": (*moe, "w_down")}
    if fused:  # the splits take the expert count from their sources: a sliced load reads only its experts' rows
        gate_up, down = x + "gate_up_proj", x + "down_proj"  # [E, 2F, D] rows [gate | up]; [E, D, F]
        if not fp8:
            pl.add(gu, [(gate_up, (E, 2 * F, D))], gp,
                   lambda a: {"v": a.reshape(-1, 2, F, D).transpose(0, 3, 1, 2)}, experts=True)
            pl.add(dn, [(down, (E, D, F))], gp, lambda a: {"v": a.transpose(0, 2, 1)}, experts=True)
            return
        if F % b:
            raise ValueError(f"fused FP8 experts with moe_intermediate_size {F}, not a multiple of the FP8 block {b}: "
                             "a scale block straddles gate and up; load with fp8='dequantize'")

        def split_gate_up(v: np.ndarray, sc: np.ndarray) -> dict[str, np.ndarray]:
            return {"v": v.reshape(-1, 2, F, D).transpose(0, 3, 1, 2),  # [E, D, 2, F]
                    "s": sc.reshape(-1, 2, cf, cd).transpose(0, 3, 1, 2)}  # [E, cdiv(D, b), 2, cdiv(F, b)]

        pl.add(gu, [(gate_up, (E, 2 * F, D)), (_scale_name(gate_up), (E, 2 * cf, cd))], gp, split_gate_up, raw=True,
               experts=True)
        pl.add(dn, [(down, (E, D, F)), (_scale_name(down), (E, cd, cf))], gp,
               lambda v, sc: {"v": v.transpose(0, 2, 1), "s": sc.transpose(0, 2, 1)}, raw=True, experts=True)
        return
    for e in range(E):
        gate, up, down = (f"{x}{e}.{n}_proj.weight" for n in ("gate", "up", "down"))  # [F, D], [F, D], [D, F]
        if not fp8:
            pl.add(gu, [(gate, (F, D)), (up, (F, D))], (*gp, e), lambda gw, uw: {"v": np.stack([gw.T, uw.T], axis=1)})
            pl.add(dn, [(down, (D, F))], (*gp, e), lambda a: {"v": a.T})
            continue
        pl.add(gu, [(gate, (F, D)), (up, (F, D)), (_scale_name(gate), (cf, cd)), (_scale_name(up), (cf, cd))], (*gp, e),
               lambda gv, uv, gs, us: {"v": np.stack([gv.T, uv.T], axis=1), "s": np.stack([gs.T, us.T], axis=1)},
               raw=True)
        pl.add(dn, [(down, (D, F)), (_scale_name(down), (cd, cf))], (*gp, e),
               lambda v, sc: {"v": v.T, "s": sc.T}, raw=True)


# ---------------------------------------------------------------------------------------------------------------
# Checks before reading


def _check(root: pathlib.Path, c: Config, tensors: dict, groups: list[_Group], block: int | None,
           infos: dict[Path, ArrayInfo], mtp_prefix: str | None = None) -> None:
    """Raise on missing tensors, shapes that disagree with config.json, stored dtypes of another kind than the
    declared leaves (integers for floats), FP8 tensors without (right) scales and leftover tensors; warn once
    about skipped vision / MTP tensors; note once the float-to-float casts the copy will do. For the MTP head
    (`mtp_prefix` given), leftovers are its own unread tensors only, and nothing is said of the rest."""
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
    where = f"{root} (model_type {c.model_type}, {c.num_layers} layers, {c.num_experts} experts)"
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} tensors that config.json implies are missing: "
                              f"{_some(missing)}. Check that every shard downloaded and that config.json belongs to "
                              "these weights")
    if kinds:
        raise CheckpointError(f"{where}: {len(kinds)} tensors hold another kind of number than their weight: "
                              f"{_some(kinds, 3)}. A cast would make them garbage: use a checkpoint with float "
                              "weights (export it again)")
    if wrong:
        raise CheckpointError(f"{where}: {len(wrong)} tensors disagree with config.json: {_some(wrong)}. "
                              "The config.json does not describe these weights: use the checkpoint's own config.json")
    if fp8_wrong:
        raise CheckpointError(f"{where}: {_some(fp8_wrong)}")
    rest = [n for n in tensors if n not in used]
    if mtp_prefix is not None:  # the MTP head: its own tensors only, the rest of the checkpoint is the main model's
        left = [n for n in rest if n.startswith(mtp_prefix)]
        if left:
            raise CheckpointError(f"{where}: {len(left)} MTP tensors are not weights of a one-layer MTP head: "
                                  f"{_some(left)}. This loader reads {mtp_prefix}layers.0 only (every published "
                                  "Qwen3.5 / Qwen3-Next head has one layer)")
    else:
        skipped = [n for n in rest if n.startswith(SKIPPED_PREFIXES)]
        left = [n for n in rest if not n.startswith(SKIPPED_PREFIXES)]
        if left:
            raise CheckpointError(f"{where}: {len(left)} tensors are neither weights of this text model nor vision "
                                  f"(model.visual.*) / MTP (mtp.*) weights: {_some(left)}. Is config.json the right "
                                  "one?")
        if skipped:
            warnings.warn(f"{root}: skipped {len(skipped)} vision (model.visual.*) and MTP (mtp.*) tensors; this "
                          "loads the text model only (its MTP head loads apart: checkpoint.load_mtp)", stacklevel=4)
    if casts:
        log.warning("note: %s: %d tensors are cast to their weights' dtype (%s)", root, sum(casts.values()),
                    ", ".join(f"{n} x {k}" for k, n in sorted(casts.items())))


def _check_fp8(name: str, info: safetensors_io.TensorInfo, shape: tuple[int, ...], raw: bool, block: int | None,
               tensors: dict, used: set[str], missing: list[str], wrong: list[str], fp8_wrong: list[str]) -> None:
    """FP8 sources: kept ones (`raw`) must be F8_E4M3; dequantized ones need their `scale_inv`, of the right shape."""
    if raw and not name.endswith("_scale_inv") and info.dtype != "F8_E4M3":
        fp8_wrong.append(f"{name} is {info.dtype}, not F8_E4M3 (expert_dtype float8_e4m3fn keeps FP8 experts)")
    if not raw and info.dtype == "F8_E4M3":  # dequantized on read: its scale must be there and fit
        scale = _scale_name(name)
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


def _some(items: list[str], n: int = 10) -> str:
    """The first `n` items, each printable and short (tensor names come from file headers: newlines, megabytes)."""
    shown = [i if i.isprintable() and len(i) <= 200 else safetensors_io.quote(i, 200) for i in items[:n]]
    return ", ".join(shown) + (f" ... and {len(items) - n} more" if len(items) > n else "")


def path_infos(tree: Any) -> list[tuple[Path, ArrayInfo]]:
    """(path, ArrayInfo) of every leaf, in `jax.tree` order; paths use dict keys and BlockFP8 field names."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_info)
    return [(tuple(_key(k) for k in kp), info) for kp, info in flat]


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            v = getattr(k, attr)
            return BlockFP8._fields[v] if attr == "idx" else str(v)
    raise TypeError(k)


# ---------------------------------------------------------------------------------------------------------------
# The sliced load: each device's shard read from the files, slice by slice

Box = tuple[tuple[int, int], ...]  # one device's part of a leaf: (start, stop) per dim
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _load_sliced(groups: list[_Group], infos: dict[Path, ArrayInfo], tensors: dict, block: int | None,
                 shardings: dict[Path, Any], bar: _Progress) -> dict[Path, jax.Array]:
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
    plans = [(g, _boxes(g, infos, shardings)) for g in groups]
    bar.start(sum(len(ops) for _, boxes in plans for ops, _, _ in boxes),
              sum(_op_bytes(op, rows, tensors) for _, boxes in plans for ops, rows, _ in boxes for op in ops))
    out: dict[Path, jax.Array] = {}
    for group, boxes in plans:
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


def _boxes(group: _Group, infos: dict[Path, ArrayInfo], shardings: dict[Path, Any]
           ) -> list[tuple[list[_Op], tuple[int, int] | None, tuple[dict[str, Box], list]]]:
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


def _piece_bytes(group: _Group, infos: dict[Path, ArrayInfo], shardings: dict[Path, Any]) -> int:
    """The largest piece one op of `group` writes into one device's shard of one of its leaves."""
    k = len(group.ops[0].index)
    return max(math.prod(shardings[p].shard_shape(infos[p].shape)[k:]) * np.dtype(infos[p].dtype).itemsize
               for p in group.leaves.values())


def _op_bytes(op: _Op, rows: tuple[int, int] | None, tensors: dict) -> int:
    """The stored bytes an op reads (its sources' rows only for fused experts)."""
    total = 0
    for n in op.sources:
        info = tensors[n].tensors[n]
        nbytes = info.end - info.begin
        total += nbytes * (rows[1] - rows[0]) // info.shape[0] if op.experts and rows and info.shape[0] else nbytes
    return total


def _build_box(group: _Group, ops: list[_Op], rows: tuple[int, int] | None, boxes: dict[str, Box], devices: list,
               infos: dict[Path, ArrayInfo], tensors: dict, block: int | None, chunk: int, bar: _Progress
               ) -> dict[str, list[jax.Array]]:
    """The shards of `group`'s leaves in `boxes`, one per device of `devices` (see `_load_sliced`, step 2)."""
    k = len(group.ops[0].index)
    leaves = {key: infos[p] for key, p in group.leaves.items()}
    shapes = {key: tuple(z - a for a, z in boxes[key]) for key in leaves}
    on_host = sum(math.prod(shapes[key]) * np.dtype(i.dtype).itemsize for key, i in leaves.items()) <= chunk
    host = {key: np.empty(shapes[key], i.dtype) for key, i in leaves.items()} if on_host else {}
    dev = {} if on_host else {key: [_zeros(shapes[key], i.dtype, d) for d in devices] for key, i in leaves.items()}
    for op in ops:
        cut = rows if op.experts else None
        pieces = op.split(*(_read(tensors, n, block, op.raw, cut) for n in op.sources))
        bar.update(1, _op_bytes(op, cut, tensors))
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


class _Progress:
    """A tqdm bar on stderr over the tensors read and their bytes (`enabled` None: only on a terminal)."""

    def __init__(self, enabled: bool | None, what: str):
        self.enabled, self.what, self.bar, self.tensors, self.done = enabled, what, None, 0, 0

    def start(self, tensors: int, nbytes: int) -> None:
        from tqdm.auto import tqdm

        self.tensors = tensors
        self.bar = tqdm(total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"loading {self.what}",
                        disable=None if self.enabled is None else not self.enabled, file=sys.stderr)

    def update(self, tensors: int, nbytes: int) -> None:
        self.done += tensors
        self.bar.set_postfix_str(f"{self.done}/{self.tensors} reads", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
