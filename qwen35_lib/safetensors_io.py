"""A small reader and writer of the safetensors format: an 8-byte header length, a JSON header, raw data.

Reading never unpickles: the header is JSON and the data is mapped with `np.memmap`, so a tensor is a
zero-copy, read-only view whose bytes are read from disk only when used. bfloat16 and float8 come from
`ml_dtypes` (the dtypes JAX itself uses).

Format (https://github.com/huggingface/safetensors): `u64 little-endian N`, then N bytes of JSON
`{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}}`,
then the data; offsets count from the end of the header; everything is little-endian and C-ordered.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from typing import NamedTuple

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {dt: name for name, dt in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit

# Called as hook(path, name) on every `SafeTensorsFile.get`; tests count reads with it.
READ_HOOKS: list[Callable[[str, str], None]] = []


class TensorInfo(NamedTuple):
    dtype: str  # the safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


class SafeTensorsFile:
    """One `.safetensors` file: its header on open, each tensor as a memmap view on `get`.

    Steps: 1. read and check the header; 2. map the data section once (lazily paged by the OS);
    3. `get(name)` slices the map and views it as the tensor's dtype and shape (no copy).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(f"{self.path}: header length {n} is impossible for a {size}-byte file "
                                 "(truncated download, or not a safetensors file)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: the safetensors header is not valid JSON ({e})") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_size = size - self._data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            if h["dtype"] not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {h['dtype']!r}; "
                                 f"supported: {', '.join(DTYPES)}")
            info = TensorInfo(h["dtype"], tuple(h["shape"]), *h["data_offsets"])
            nbytes = math.prod(info.shape) * DTYPES[info.dtype].itemsize
            if info.end - info.begin != nbytes or not 0 <= info.begin <= info.end <= data_size:
                raise ValueError(f"{self.path}: tensor {name!r} has offsets {info.begin}..{info.end} that do not "
                                 f"fit its shape {info.shape} ({nbytes} bytes) inside {data_size} data bytes")
            self.tensors[name] = info
        self._map: np.ndarray | None = None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` as a read-only memmap view (copy it with `np.array` to keep it past `close`)."""
        info = self.tensors[name]
        for hook in READ_HOOKS:
            hook(self.path, name)
        if self._map is None:
            if os.path.getsize(self.path) == self._data_start:  # mmap refuses an empty region
                self._map = np.zeros(0, np.uint8)
            else:
                self._map = np.memmap(self.path, np.uint8, mode="r", offset=self._data_start)
        return self._map[info.begin:info.end].view(DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        self._map = None  # the OS unmaps once no view refers to it

    def __enter__(self) -> SafeTensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a file, copied into memory."""
    with SafeTensorsFile(path) as f:
        return {name: np.array(f.get(name)) for name in f.keys()}


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (numpy, ml_dtypes allowed) as a safetensors file.

    Steps: 1. lay the tensors out back to back in name order; 2. write the JSON header, padded with spaces
    to a multiple of 8 bytes as the reference writer does; 3. write each tensor's little-endian bytes.
    """
    header: dict[str, dict] = {}
    arrays: list[np.ndarray] = []
    offset = 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dt not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {a.dtype}, which safetensors cannot store here; "
                             f"use one of {', '.join(str(d) for d in _NAMES)}")
        a = np.ascontiguousarray(a, dtype=dt)
        header[name] = {"dtype": _NAMES[dt], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data if a.size else b"")
