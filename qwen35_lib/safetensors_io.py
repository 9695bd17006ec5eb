"""A small, strict reader and a writer of the safetensors format: an 8-byte header length, a JSON header, raw data.

Reading never unpickles: the header is JSON and the data is mapped with `np.memmap`, so a tensor is a
zero-copy, read-only view whose bytes are read from disk only when used. bfloat16 and float8 come from
`ml_dtypes` (the dtypes JAX itself uses).

Format (https://github.com/huggingface/safetensors): `u64 little-endian N`, then N bytes of JSON
`{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}}`,
then the data; offsets count from the end of the header; everything is little-endian and C-ordered.

The reader enforces the format's rules (the reference reader's): N at most 100 MB; the header a JSON object
of entries, each with a known `dtype`, a `shape` of non-negative ints and `data_offsets` [begin, end]; the
entries, in offset order, tile the data section exactly (no gap, no overlap, nothing after the last);
end - begin = prod(shape) * itemsize. Any breach is a `SafeTensorsError` with a one-line message that names
the file and the entry, never the file's bytes.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
NAMES = {dt: name for name, dt in DTYPES.items()}
MAX_HEADER = 100_000_000  # bytes; the reference reader's limit
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")

# Called as hook(path, name) on every `SafeTensorsFile.get`; tests count reads with it.
READ_HOOKS: list[Callable[[str, str], None]] = []


class SafeTensorsError(ValueError):
    """A file that breaks the safetensors format (one line: the file, the entry, what is wrong)."""


class TensorInfo(NamedTuple):
    dtype: str  # the safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


def kind(dtype: str) -> str:
    """"float", "int" or "bool": what a stored dtype holds (a cast may change the width, never the kind)."""
    return "float" if dtype in FLOATS else "bool" if dtype == "BOOL" else "int"


def quote(name: Any, limit: int = 80) -> str:
    """`repr(name)`, cut to `limit` characters: header strings are untrusted (newlines, megabytes)."""
    r = repr(name)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def open_regular(path: str) -> Any:
    """`open(path, "rb")` for a regular file (a symlink to one is fine); anything else (a FIFO, a device, a
    directory) is refused without blocking: the open is non-blocking and the type checked on the open file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise SafeTensorsError(f"{path}: is a directory, not a safetensors file") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SafeTensorsError(f"{path}: not a regular file ({_file_type(mode)}); a checkpoint's weights are "
                                   "regular files (or symlinks to them)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def parse_header(raw: bytes, data_size: int, where: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The JSON header bytes -> (tensors by name, metadata), checked against a `data_size`-byte data section.

    1. JSON (UTF-8, no NaN constants, no duplicate names, no lone surrogate escapes) holding an object;
    2. `__metadata__`: absent, null or a str -> str object;
    3. every other entry: an object with a known `dtype`, a `shape` of non-negative ints, `data_offsets` of
       two ints, end - begin = the shape's bytes;
    4. sorted by offsets the entries tile [0, data_size) exactly.
    """
    def fail(message: str) -> SafeTensorsError:
        return SafeTensorsError(f"{where}: {message}")

    header = _header_json(raw, fail)
    metadata = _metadata(header.pop("__metadata__", None), fail)
    tensors = {name: _entry(name, h, fail) for name, h in header.items()}
    _check_tiling(tensors, data_size, fail)
    return tensors, metadata


def _header_json(raw: bytes, fail: Callable[[str], SafeTensorsError]) -> dict[str, Any]:
    """Step 1: UTF-8 JSON, no NaN constants, no duplicate names, no lone surrogate escapes, an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"the header is not UTF-8 text (bad byte at offset {8 + e.start}); not a safetensors file, "
                   "or a corrupt one") from None

    def no_constants(name: str) -> Any:
        raise fail(f"the header holds the JSON constant {name}, which is not valid JSON")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:  # every object: unique keys, valid text
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise fail(f"the header names {quote(k)} twice")
            for t in (k, v) if isinstance(v, str) else (k,):
                if not _unicode(t):
                    raise fail(f"the header string {quote(t)} holds a lone surrogate escape, which is not Unicode")
            out[k] = v
        return out

    try:
        header = json.loads(text, object_pairs_hook=unique, parse_constant=no_constants)
    except json.JSONDecodeError as e:
        raise fail(f"the header is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                   "a truncated or corrupt file: download it again") from None
    except RecursionError:
        raise fail("the header is nested too deeply to be a safetensors header") from None
    if not isinstance(header, dict):
        raise fail(f"the header is a JSON {_json_type(header)}, not an object of tensor entries")
    return header


def _metadata(metadata: Any, fail: Callable[[str], SafeTensorsError]) -> dict[str, str]:
    """Step 2: `__metadata__` absent, null or an object of strings."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise fail(f"__metadata__ is a JSON {_json_type(metadata)}; it must be an object of strings")
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise fail(f"__metadata__[{quote(k)}] is a JSON {_json_type(v)}; metadata values must be strings")
    return metadata


def _check_tiling(tensors: dict[str, TensorInfo], data_size: int, fail: Callable[[str], SafeTensorsError]) -> None:
    """Step 4: sorted by offsets, the entries tile [0, data_size) exactly."""
    end = 0
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != end:
            what = "overlaps the previous tensor" if info.begin < end else "leaves a gap before it"
            raise fail(f"tensor {quote(name)} starts at byte {info.begin}, where {end} was next: it {what} "
                       "(entries must tile the data section in order)")
        end = info.end
    if end != data_size:
        raise fail(f"the tensors cover {end} data bytes, the file holds {data_size}: "
                   + ("truncated: download it again" if end > data_size else "bytes after the last tensor"))


def _entry(name: str, h: Any, fail: Callable[[str], SafeTensorsError]) -> TensorInfo:
    """One header entry, checked: `{"dtype": str, "shape": [int >= 0], "data_offsets": [begin, end]}`."""
    if not isinstance(h, dict):
        raise fail(f"tensor {quote(name)} is a JSON {_json_type(h)}, not an object with {', '.join(_ENTRY_KEYS)}")
    lacking = [k for k in _ENTRY_KEYS if k not in h]
    if lacking:
        raise fail(f"tensor {quote(name)} has no {' and no '.join(lacking)}")
    dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise fail(f"tensor {quote(name)} has dtype {quote(dtype, 40)}; supported: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise fail(f"tensor {quote(name)} has shape {quote(shape, 60)}; a shape is a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(n) and n >= 0 for n in offsets)
            and offsets[0] <= offsets[1]):
        raise fail(f"tensor {quote(name)} has data_offsets {quote(offsets, 60)}; they must be [begin, end] with "
                   "0 <= begin <= end")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise fail(f"tensor {quote(name)} spans {offsets[1] - offsets[0]} bytes (data_offsets {offsets}), but "
                   f"{dtype} {tuple(shape)} is {nbytes} bytes")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def _unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _json_type(x: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(x), "number")


class SafeTensorsFile:
    """One `.safetensors` file: its header on open, each tensor as a memmap view on `get`.

    Steps: 1. open a regular file (never blocking on a FIFO); 2. read the header length (at most `MAX_HEADER`)
    and the header, and check it (`parse_header`); 3. map the data section once (lazily paged by the OS);
    4. `get(name)` slices the map and views it as the tensor's dtype and shape (no copy).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open_regular(self.path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise SafeTensorsError(f"{self.path}: not a safetensors file ({size} bytes, shorter than the "
                                       "8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise SafeTensorsError(f"{self.path}: not a safetensors file: its header length field is over the "
                                       f"format's {MAX_HEADER // 1_000_000} MB limit")
            if 8 + n > size:
                raise SafeTensorsError(f"{self.path}: its header length field exceeds the file's {size} bytes "
                                       "(a truncated download, or not a safetensors file)")
            raw = f.read(n)
        if len(raw) != n:
            raise SafeTensorsError(f"{self.path}: the file shrank while its header was read")
        self._data_start = 8 + n
        self._size = size
        self.tensors, self.metadata = parse_header(raw, size - self._data_start, self.path)
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
            if self._size == self._data_start:  # mmap refuses an empty region
                self._map = np.zeros(0, np.uint8)
            else:
                with open_regular(self.path) as f:
                    if os.fstat(f.fileno()).st_size != self._size:
                        raise SafeTensorsError(f"{self.path}: the file changed size since it was opened")
                    self._map = np.memmap(f, np.uint8, mode="r", offset=self._data_start)
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
        if dt not in NAMES:
            raise SafeTensorsError(f"tensor {name!r} has dtype {a.dtype}, which safetensors cannot store here; "
                             f"use one of {', '.join(str(d) for d in NAMES)}")
        a = np.ascontiguousarray(a, dtype=dt)
        header[name] = {"dtype": NAMES[dt], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
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
