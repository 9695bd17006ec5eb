"""The strict safetensors reader: each rule of the format refused with a one-line `SafeTensorsError`, and fuzzing.

Files are built raw (`testing.write_raw_safetensors`), so a broken header is exactly the one written. The fuzz
tests corrupt valid files at random: every corruption that breaks a rule ends in `SafeTensorsError` with one
short line, never another exception; random byte flips either load (then the `safetensors` package, the
format's reference reader, loads the same entries) or end in `SafeTensorsError`.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen35_lib import safetensors_io, testing
from qwen35_lib.safetensors_io import DTYPES, SafeTensorsError, SafeTensorsFile

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def layout(specs: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[dict, bytes]:
    """A valid header for `{name: (dtype, shape)}`, laid out back to back in name order, and its data bytes."""
    header, offset = {}, 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        n = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    return header, bytes((7 * i + 3) % 251 for i in range(offset))  # no whitespace runs, no zeros


BASE = {"a": ("F32", (2, 3)), "b": ("I8", (5,)), "e": ("F64", (0,)), "h": ("BF16", (4,))}


def load(path) -> dict[str, np.ndarray]:
    """Open the file and read every tensor (the whole reader runs)."""
    with SafeTensorsFile(path) as f:
        return {name: np.array(f.get(name)) for name in f.keys()}


def refused(path, match: str) -> str:
    with pytest.raises(SafeTensorsError, match=match) as e:
        load(path)
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def test_a_valid_raw_file_loads(tmp_path):
    header, data = layout(BASE)
    testing.write_raw_safetensors(tmp_path / "x", {**header, "__metadata__": {"format": "pt"}}, data)
    got = load(tmp_path / "x")
    assert {n: (str(a.dtype), a.shape) for n, a in got.items()} == {
        "a": ("float32", (2, 3)), "b": ("int8", (5,)), "e": ("float64", (0,)), "h": ("bfloat16", (4,))}
    assert got["b"].tobytes() == data[24:29]
    assert SafeTensorsFile(tmp_path / "x").metadata == {"format": "pt"}


def test_new_dtypes_round_trip(tmp_path):
    """F8_E5M2 and the unsigned ints load, and the reference reader agrees on their bytes."""
    safetensors = pytest.importorskip("safetensors")
    arrays = {"f8": np.arange(6, dtype=np.float32).astype(ml_dtypes.float8_e5m2),
              "u16": np.arange(3, dtype=np.uint16), "u32": np.arange(3, dtype=np.uint32),
              "u64": np.arange(3, dtype=np.uint64)}
    safetensors_io.save_file(arrays, tmp_path / "x")
    got = safetensors_io.load_file(tmp_path / "x")
    header, _ = testing.read_raw_safetensors(tmp_path / "x")
    assert {n: h["dtype"] for n, h in header.items()} == {"f8": "F8_E5M2", "u16": "U16", "u32": "U32", "u64": "U64"}
    with safetensors.safe_open(tmp_path / "x", "numpy") as f:
        for name in ("u16", "u32", "u64"):
            np.testing.assert_array_equal(f.get_tensor(name), got[name])
    np.testing.assert_array_equal(got["f8"].view(np.uint8), arrays["f8"].view(np.uint8))


def _with(header: dict, name: str, **fields) -> dict:
    return {**header, name: {**header[name], **fields}}


def _without(header: dict, name: str, key: str) -> dict:
    return {**header, name: {k: v for k, v in header[name].items() if k != key}}


H, D = layout(BASE)
CASES = [  # (header as dict or raw bytes, data, the error it must give)
    (b"[1, 2]", b"", "the header is a JSON array, not an object"),
    (b'{"a": 1', b"", r"not valid JSON \(Expecting .* at line 1, column 8\)"),
    (b'{"x": NaN}', b"", "JSON constant NaN"),
    (b'\xff\xfe{}', b"", r"not UTF-8 text \(bad byte at offset 8\)"),
    (b'{"a": {"dtype": "U8", "shape": [], "data_offsets": [0, 1]}, "a": {}}', b"x", "names 'a' twice"),
    ({**H, "__metadata__": ["x"]}, D, "__metadata__ is a JSON array"),
    ({**H, "__metadata__": {"k": 5}}, D, r"__metadata__\['k'\] is a JSON number; metadata values must be strings"),
    ({**H, "a": [0, 24]}, D, "tensor 'a' is a JSON array, not an object"),
    (_without(H, "a", "dtype"), D, "tensor 'a' has no dtype"),
    (_without(H, "b", "data_offsets"), D, "tensor 'b' has no data_offsets"),
    (_with(H, "a", dtype="F128"), D, "tensor 'a' has dtype 'F128'; supported: F64"),
    (_with(H, "a", dtype=["F32"]), D, r"tensor 'a' has dtype \['F32'\]"),
    (_with(H, "a", shape="2x3"), D, "tensor 'a' has shape '2x3'; a shape is a list of non-negative integers"),
    (_with(H, "a", shape=[2, -3]), D, r"shape \[2, -3\]"),
    (_with(H, "a", shape=[2.0, 3]), D, r"shape \[2.0, 3\]"),
    (_with(H, "a", shape=[True, 6]), D, r"shape \[True, 6\]"),
    (_with(H, "a", data_offsets=[0]), D, r"data_offsets \[0\]; they must be \[begin, end\]"),
    (_with(H, "a", data_offsets=[24, 0]), D, r"data_offsets \[24, 0\]"),
    (_with(H, "a", data_offsets=[-1, 23]), D, r"data_offsets \[-1, 23\]"),
    (_with(H, "a", data_offsets=[0, "24"]), D, r"data_offsets \[0, '24'\]"),
    (_with(H, "a", shape=[3, 3]), D, r"tensor 'a' spans 24 bytes .* but F32 \(3, 3\) is 36 bytes"),
    (_with(H, "b", data_offsets=[0, 5]), D, "tensor 'a' starts at byte 0, where 5 was next: it overlaps"),
    (_with(H, "h", data_offsets=[30, 38]), D + b"\0", "tensor 'h' starts at byte 30, where 29 was next: it leaves"),
    (H, D + b"tail", "the tensors cover 37 data bytes, the file holds 41: bytes after the last tensor"),
    (H, D[:-1], "the tensors cover 37 data bytes, the file holds 36: truncated"),
    ({**H, "x\ny": {**H["e"], "dtype": "X"}}, D, r"tensor 'x\\ny' has dtype 'X'"),
    ({**H, "a" * 10_000: 1}, D, r"tensor 'aaaa.*\.\.\. is a JSON number"),
]


@pytest.mark.parametrize("header, data, match", CASES, ids=[c[2][:40] for c in CASES])
def test_each_rule(tmp_path, header, data, match):
    testing.write_raw_safetensors(tmp_path / "x", header, data)
    refused(tmp_path / "x", match)


def test_overlapping_tensors_are_refused(tmp_path):
    """Two entries over the same bytes (one would be a silent copy of the other)."""
    header, data = layout({"a": ("F32", (4,)), "b": ("F32", (4,))})
    header["b"]["data_offsets"] = header["a"]["data_offsets"]
    testing.write_raw_safetensors(tmp_path / "x", header, data[:16])
    refused(tmp_path / "x", "tensor 'b' starts at byte 0, where 16 was next: it overlaps the previous tensor")


def test_the_header_length_field(tmp_path):
    """Too short a file, a length over the 100 MB cap, a length past the end: the length is not printed."""
    (tmp_path / "short").write_bytes(b"abc")
    refused(tmp_path / "short", r"not a safetensors file \(3 bytes, shorter than the 8-byte header length\)")
    big = 2**40 + 12345
    testing.write_raw_safetensors(tmp_path / "big", b"{}", length=big)
    assert str(big) not in refused(tmp_path / "big", "header length field is over the format's 100 MB limit")
    testing.write_raw_safetensors(tmp_path / "past", b"{}", length=1000)
    refused(tmp_path / "past", "its header length field exceeds the file's 10 bytes")


def test_errors_never_print_file_contents(tmp_path):
    """A text file (the first 8 bytes make a huge length) and a JSON-ish one: their bytes are not in the message."""
    secret = b"password=hunter2 and more secret text here"
    (tmp_path / "text").write_bytes(secret)
    message = refused(tmp_path / "text", "not a safetensors file")
    assert "hunter2" not in message and "password" not in message
    assert str(struct.unpack("<Q", secret[:8])[0]) not in message
    testing.write_raw_safetensors(tmp_path / "json", b'{"hunter2": ' + b"x" * 20, b"")
    assert "hunter2" not in refused(tmp_path / "json", "not valid JSON")


@pytest.mark.timeout(30)
def test_special_files_are_refused_without_blocking(tmp_path):
    """A FIFO would block `open` until a writer comes; it is refused at once. So is a directory."""
    os.mkfifo(tmp_path / "fifo.safetensors")
    refused(tmp_path / "fifo.safetensors", r"not a regular file \(a FIFO\)")
    (tmp_path / "dir.safetensors").mkdir()
    refused(tmp_path / "dir.safetensors", "directory")


def test_a_symlink_to_a_file_is_fine(tmp_path):
    header, data = layout(BASE)
    testing.write_raw_safetensors(tmp_path / "blob", header, data)
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "blob")
    assert load(tmp_path / "link.safetensors").keys() == BASE.keys()


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing

NAMES = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(lambda n: n != "__metadata__")
SPECS = st.dictionaries(NAMES, st.tuples(st.sampled_from(list(DTYPES)), st.lists(st.integers(0, 4), max_size=3)
                                         .map(tuple)), min_size=1, max_size=4)
JSON = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)
NOT_A_SHAPE = JSON.filter(lambda v: not (isinstance(v, list) and all(type(n) is int and n >= 0 for n in v)))
NOT_OFFSETS = JSON.filter(lambda v: not (isinstance(v, list) and len(v) == 2 and all(type(n) is int for n in v)))


@st.composite
def corrupted(draw) -> tuple[bytes, str]:
    """A valid file's bytes, broken by one corruption that breaks a rule of the format; and its kind."""
    header, data = layout(draw(SPECS))
    names = sorted(header)
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from(["drop_key", "dtype", "shape", "offsets", "shift", "reshape", "length", "truncate",
                                 "append", "not_object", "garbage", "duplicate", "entry_type", "metadata"]))
    blob = _break_header(draw, kind, header, name)
    if blob is None:
        blob = json.dumps(header).encode()
    return _break_file(draw, kind, struct.pack("<Q", len(blob)) + blob + data, len(blob)), kind


def _break_header(draw, kind: str, header: dict, name: str) -> bytes | None:
    """`corrupted`'s header corruptions: `header` changed in place, or the header bytes themselves (None: the
    changed header, as JSON)."""
    entry = header[name]
    if kind == "drop_key":
        del entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    elif kind == "dtype":
        entry["dtype"] = draw(JSON.filter(lambda v: not (isinstance(v, str) and v in DTYPES)))
    elif kind == "shape":
        entry["shape"] = draw(NOT_A_SHAPE)
    elif kind == "offsets":
        entry["data_offsets"] = draw(NOT_OFFSETS)
    elif kind == "shift":  # move one end of one entry: a gap, an overlap, a wrong size or a wrong total
        i = draw(st.integers(0, 1))
        entry["data_offsets"][i] += draw(st.integers(-40, 40).filter(bool))
    elif kind == "reshape":
        entry["shape"] = _other_shape(draw, entry)
    elif kind == "not_object":
        return json.dumps(draw(JSON.filter(lambda v: not isinstance(v, dict)))).encode()
    elif kind == "garbage":
        return draw(st.binary(min_size=1, max_size=40)).replace(b"{", b"(")  # never an object
    elif kind == "duplicate":
        text = json.dumps(header)
        return (text[:-1] + ", " + json.dumps(name) + ": " + json.dumps(entry) + "}").encode()
    elif kind == "entry_type":
        header[name] = draw(JSON.filter(lambda v: not isinstance(v, dict)))
    elif kind == "metadata":
        header["__metadata__"] = draw(JSON.filter(lambda v: v is not None and not (
            isinstance(v, dict) and all(isinstance(x, str) for x in v.values()))))
    return None


def _other_shape(draw, entry: dict) -> list[int]:
    """A shape whose bytes differ from the entry's offsets' span."""
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    itemsize = DTYPES[entry["dtype"]].itemsize
    if math.prod(shape) * itemsize == entry["data_offsets"][1] - entry["data_offsets"][0]:
        shape = [*shape, 2] if math.prod(shape) else [1]  # the product must change
        if math.prod(shape) * itemsize == entry["data_offsets"][1] - entry["data_offsets"][0]:
            shape = [3, *shape]
    return shape


def _break_file(draw, kind: str, raw: bytes, header_len: int) -> bytes:
    """`corrupted`'s file corruptions: the header length moved, the file cut short or appended to."""
    if kind == "length":  # moves the data section: the tensors no longer cover it
        n = header_len + draw(st.integers(-header_len, 64).filter(bool))
        return struct.pack("<Q", n) + raw[8:]
    if kind == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    if kind == "append":
        return raw + draw(st.binary(min_size=1, max_size=16))
    return raw


@FUZZ
@given(case=corrupted())
def test_fuzz_every_corruption_is_a_safetensors_error(tmp_path, case):
    raw, kind = case
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(raw)
    with pytest.raises(SafeTensorsError) as e:
        load(path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400, (kind, str(e.value))


JSON_BYTES = list(b'0123456789[]{}",: -+eE.tfnul\\')  # bytes that keep JSON valid more often than random ones


@st.composite
def flipped(draw) -> bytes:
    """A valid file with 1 to 4 bytes of its length field or header set to random (often JSON-ish) values."""
    header, data = layout(draw(SPECS))
    blob = json.dumps(header).encode()
    raw = bytearray(struct.pack("<Q", len(blob)) + blob + data)
    for _ in range(draw(st.integers(1, 4))):
        raw[draw(st.integers(0, 8 + len(blob) - 1))] = draw(st.integers(0, 255) | st.sampled_from(JSON_BYTES))
    return bytes(raw)


@FUZZ
@given(raw=flipped())
def test_fuzz_byte_flips_load_only_what_the_reference_loads(tmp_path, raw):
    """Either a one-line SafeTensorsError, or a load that the reference reader agrees with entry for entry."""
    safetensors = pytest.importorskip("safetensors")
    path = tmp_path / "flip.safetensors"
    path.write_bytes(raw)
    try:
        got = load(path)
    except SafeTensorsError as e:
        assert "\n" not in str(e) and len(str(e)) < 400, str(e)
        return
    with safetensors.safe_open(path, "numpy") as f:  # raises if the reference refuses what we loaded
        ref_names = set(f.keys())
        for name in ref_names:
            sl = f.get_slice(name)
            assert (sl.get_dtype(), tuple(sl.get_shape())) == (SafeTensorsFile(path).tensors[name].dtype,
                                                              got[name].shape), name
    assert ref_names == got.keys()


# the writer and the reader against the `safetensors` package (moved from the checkpoint tests)


def test_safetensors_round_trip_and_interop(tmp_path):
    """Our writer and reader agree with each other and with the `safetensors` package, for every dtype."""
    torch = pytest.importorskip("torch")
    import safetensors.numpy
    import safetensors.torch

    rng = np.random.default_rng(0)
    arrays = {dt: rng.standard_normal((3, 5)).astype(dt) for dt in
              ("float64", "float32", "float16", ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)}
    arrays.update({dt: rng.integers(-100, 100, (4,)).astype(dt) for dt in ("int64", "int32", "int16", "int8")})
    tensors = {f"t.{np.dtype(dt).name}": a for dt, a in arrays.items()}
    tensors.update({"u8": np.arange(7, dtype=np.uint8), "bool": np.array([True, False]), "empty": np.zeros((0, 3))})
    safetensors_io.save_file(tensors, tmp_path / "ours.safetensors", metadata={"format": "np"})
    with safetensors_io.SafeTensorsFile(tmp_path / "ours.safetensors") as f:
        assert f.metadata == {"format": "np"}
        for name, a in tensors.items():
            got = f.get(name)
            assert got.dtype == a.dtype and got.shape == a.shape and not got.flags.writeable
            np.testing.assert_array_equal(got.view(np.uint8), a.view(np.uint8), err_msg=name)
    with safetensors.safe_open(tmp_path / "ours.safetensors", "pt") as f:  # the reference reader reads our file
        for name, a in tensors.items():
            t = f.get_tensor(name)
            if a.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):  # numpy-less dtypes: compare the bits
                t, a = t.view(torch.uint8), a.view(np.uint8)
            np.testing.assert_array_equal(t.numpy(), a, err_msg=name)
    plain = {n: a for n, a in tensors.items() if "bfloat16" not in n and "float8" not in n}
    torch_tensors = {"bf16": torch.randn(4, 3).bfloat16(), "f8": torch.randn(5).to(torch.float8_e4m3fn)}
    safetensors.torch.save_file(torch_tensors, tmp_path / "torch.safetensors")
    safetensors.numpy.save_file(plain, tmp_path / "np.safetensors")
    ours = safetensors_io.load_file(tmp_path / "torch.safetensors")
    for name, t in torch_tensors.items():
        np.testing.assert_array_equal(ours[name].view(np.uint8), t.view(torch.uint8).numpy(), err_msg=name)
    for name, a in safetensors_io.load_file(tmp_path / "np.safetensors").items():
        np.testing.assert_array_equal(a, plain[name], err_msg=name)


def test_safetensors_rejects_bad_files(tmp_path):
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_io.SafeTensorsFile(tmp_path / "short")
    safetensors_io.save_file({"x": np.zeros(10, np.float32)}, tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(safetensors_io.SafeTensorsError, match=r"cover 40 data bytes, the file holds 32: truncated"):
        safetensors_io.SafeTensorsFile(tmp_path / "cut.safetensors")

