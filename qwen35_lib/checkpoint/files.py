"""The checkpoint's files: the safetensors files a folder (or its index) names, each tensor's open file, the FP8
block size config.json declares, reading a tensor (dequantized, or some rows of it), and the progress bar over the
reads. `CheckpointError` is every refusal of the loader."""

from __future__ import annotations

import os
import pathlib
import stat
import sys

import jax.numpy as jnp
import numpy as np

from qwen35_lib import safetensors_io
from qwen35_lib.config import ConfigError, read_json
from qwen35_lib.weights import dequantize_fp8_np

FP8 = np.dtype(jnp.float8_e4m3fn)
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder whose files do not make this model's weights (one line: what is wrong, the fix)."""


def open_files(root: pathlib.Path) -> dict[str, safetensors_io.SafeTensorsFile]:
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


def quant_block(hf: dict, where: pathlib.Path) -> int | None:
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


def scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def experts_are_fp8(tensors: dict, prefix: str) -> bool:
    return any(n.startswith(prefix + "layers.") and ".mlp.experts." in n and f.tensors[n].dtype == "F8_E4M3"
               for n, f in tensors.items())


def read(tensors: dict, name: str, block: int | None, raw: bool, rows: tuple[int, int] | None = None) -> np.ndarray:
    """A tensor as stored (`raw`, or not FP8), or dequantized to float32 with its `scale_inv`; with `rows`
    (start, stop), only those rows of dim 0 (and of the scale's dim 0: fused experts, one scale row per expert)."""
    value = tensors[name].get(name)
    cut = slice(None) if rows is None else slice(*rows)
    if raw or value.dtype != FP8:
        return value[cut]
    scale = scale_name(name)
    return dequantize_fp8_np(value[cut], tensors[scale].get(scale)[cut], block)



class Progress:
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
