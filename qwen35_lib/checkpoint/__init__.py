"""Load HuggingFace safetensors checkpoints of Qwen3.5 MoE and Qwen3-Next into our weight tree.

Public: `load_hf_checkpoint(path, ...) -> (Config, weights)`. The tree is exactly `declare(config)`'s, filled.
`load_mtp(path, ...) -> (Config, mtp_weights)`: the multi-token-prediction head (`mtp.*`), a tree of its own
(`model.mtp.declare_mtp(config)`), read by the same groups, checks and readers (opt-in: the main load skips it).

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

import dataclasses
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.checkpoint.checks import check, some
from qwen35_lib.checkpoint.files import (
    CheckpointError,
    Progress,
    experts_are_fp8,
    open_files,
    quant_block,
    read,
    scale_name,
)
from qwen35_lib.checkpoint.names import (
    MTP_PREFIXES,
    SKIPPED_PREFIXES,
    Group,
    Path,
    model_groups,
    mtp_groups,
    path_infos,
)
from qwen35_lib.checkpoint.sliced import load_sliced, op_bytes
from qwen35_lib.config import Config, ConfigError, eos_ids, from_hf_config, read_json
from qwen35_lib.weights import ArrayInfo, declare, is_info

Place = Callable[[Path, np.ndarray, ArrayInfo], Any]
__all__ = ["CheckpointError", "MTP_PREFIXES", "SKIPPED_PREFIXES", "Place", "default_place", "load_hf_checkpoint",
           "load_mtp", "path_infos", "sharded_place"]


def default_place(path: Path, array: np.ndarray, info: ArrayInfo) -> jax.Array:
    """Put a loaded leaf on the default device (a sharded loader passes its own `place`)."""
    return jnp.asarray(array)


def sharded_place(config: Config, plan, mesh) -> Place:
    """A `place` that cuts each whole host leaf into its shards under the serving `plan` on `mesh`
    (`make_array_from_callback`): no device holds a whole leaf, but the host does, one at a time. The reference
    twin of the sliced load (`load_hf_checkpoint(..., mesh=)`), which never builds a whole leaf."""
    from jax.sharding import NamedSharding

    from qwen35_lib.parallel.shardings import spec

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
      device's shard of every leaf is read from the memory-mapped files, piece by piece (`load_sliced`), so the
      host never holds a whole leaf: beyond the weights on the devices, one op's piece for one device (e.g. one
      expert's tensors), or small shards of at most that many bytes together. A tqdm bar shows the reads.
    check_weights: refuse NaN / Inf weights (a jitted `isfinite` reduction per placed leaf, on its devices: no
      host scan); False skips it.
    progress: a tqdm bar on stderr over the tensors read and their bytes; None (default): only on a terminal.
    config_changes: fields of `Config` to override (e.g. `gdn_state_dtype="bfloat16"`).

    1. Find the safetensors files (`model.safetensors.index.json`, else every `*.safetensors`); build the Config
       (EOS ids from `generation_config.json` when present).
    2. Groups: for every group of leaves, the HF tensors it needs, their expected shapes, and how they split.
    3. Check before reading: missing tensors, shapes that disagree with config.json, stored dtypes of the wrong
       kind, leftover tensors.
    4. With a mesh, every device's shards read slice by slice (`load_sliced`); else per group: allocate the numpy
       leaves, copy every source in (each read once) and `place` each leaf (`_load_whole`).
    5. Check every leaf against `declare(config)`; start its finiteness check.
    6. Wait for the finiteness checks; name the HF tensors of any leaf that failed.
    """
    ck = _open_checkpoint(path, dtype, fp8, place, mesh, layout, config_changes)
    groups = model_groups(ck.config, ck.prefix, ck.tensors, ck.tied)
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
    groups = mtp_groups(ck.config, prefix, ck.tensors)
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
    quant = quant_block(hf, config_path)
    tensors = open_files(root)
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


def _load_tree(ck: _Checkpoint, decl: Any, groups: list[Group], place: Place | None, mesh, check_weights: bool,
               progress: bool | None, mtp_prefix: str | None = None) -> Any:
    """`load_hf_checkpoint`'s steps 3-6 for the tree `decl` filled by `groups` (the main model's, or the MTP head's
    when `mtp_prefix` names its tensors): check, read, check every leaf, wait for the finiteness checks."""
    root, config, tensors = ck.root, ck.config, ck.tensors
    infos = dict(path_infos(decl))
    check(root, config, tensors, groups, ck.quant, infos, mtp_prefix)
    bar = Progress(progress, root.name if mtp_prefix is None else f"{root.name} (MTP head)")
    try:
        if mesh is not None:
            out = load_sliced(groups, infos, tensors, ck.quant, _shardings(config, ck.plan, mesh, infos), bar)
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
    assert out.keys() == infos.keys(), f"internal error: no group for {sorted(set(infos) - set(out))}"
    bad = [p for (p, _), ok in zip(finite, jax.device_get([f for _, f in finite]), strict=True) if not ok]
    if bad:
        names = list(dict.fromkeys(n for p in bad for n in _nonfinite_sources(p, out[p], groups, tensors)))
        raise CheckpointError(f"{root}: {len(names)} tensors hold NaN or Inf values: {some(names)} (leaves "
                              f"{', '.join('/'.join(p) for p in bad[:5])}); the checkpoint is corrupt: download it "
                              "again, or pass check_weights=False (CLI: --no-check-weights) to load it anyway")
    return jax.tree.structure(decl, is_leaf=is_info).unflatten([out[p] for p in infos])


def _load_whole(groups: list[Group], infos: dict[Path, ArrayInfo], tensors: dict, block: int | None, place: Place,
                bar: Progress) -> dict[Path, Any]:
    """Per group: allocate the whole numpy leaves, copy every source in (each read once), `place` each leaf."""
    bar.start(sum(len(g.ops) for g in groups), sum(op_bytes(op, None, tensors) for g in groups for op in g.ops))
    out: dict[Path, Any] = {}
    for group in groups:
        arrays = {key: np.empty(infos[p].shape, infos[p].dtype) for key, p in group.leaves.items()}
        for op in group.ops:
            sources = [read(tensors, n, block, op.raw) for n in op.sources]
            for key, piece in op.split(*sources).items():
                target = arrays[key][op.index]
                assert piece.shape == target.shape, (group.leaves[key], op.index, piece.shape, target.shape)
                target[...] = piece  # casts to the declared dtype
            bar.update(1, op_bytes(op, None, tensors))
        for key, p in group.leaves.items():
            out[p] = place(p, arrays.pop(key), infos[p])
    return out


def _shardings(config: Config, plan, mesh, infos: dict[Path, ArrayInfo]) -> dict[Path, Any]:
    from jax.sharding import NamedSharding

    from qwen35_lib.parallel.shardings import spec

    layout = plan.bound(mesh, config)
    return {p: NamedSharding(mesh, spec(layout, mesh, i.logical_axes, i.shape)) for p, i in infos.items()}


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    """A scalar: no NaN or Inf in `x`; each device reduces its own shards, then one small all-reduce."""
    return jnp.all(jnp.isfinite(x))


def _nonfinite_sources(path: Path, leaf: jax.Array, groups: list[Group], tensors: dict) -> list[str]:
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
        stored = [*op.sources, *(scale_name(n) for n in op.sources if not op.raw and tensors[n].tensors[n].dtype
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
    if fp8 == "keep" and quant and experts_are_fp8(tensors, prefix):
        changes.setdefault("expert_dtype", "float8_e4m3fn")
    return changes

