"""kernels.native.build: a C++ kernel built once into the cache under a name that hashes its inputs; a compiler that
fails leaves the kernel unavailable with the reason (and the XLA fallbacks run), never a crash."""

import pytest

from qwen35_lib.kernels.native import build as native


def test_build_is_cached_and_keyed_by_the_source(tmp_path, monkeypatch):
    cxx = native.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("QWEN35_NATIVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.cc").write_text('extern "C" int answer() { return 42; }\n')
    monkeypatch.setattr(native, "SOURCE_DIR", src)
    first = native.build("k", cxx)
    assert first.parent == tmp_path / "cache" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert native.build("k", cxx) == first and first.stat().st_mtime_ns == mtime  # not built again
    (src / "k.cc").write_text('extern "C" int answer() { return 43; }\n')
    assert native.library_path("k", cxx) != first  # a new source, a new library
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temporary file left behind


def test_a_failing_compiler_leaves_the_kernel_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN35_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exits 1 and prints nothing
    native.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="native kernel moe unavailable"):
            assert native.load("moe") is None
        assert native.unavailable("moe") == "false failed on moe.cc: no output"
        assert list(tmp_path.iterdir()) == []
        monkeypatch.setenv("QWEN35_NATIVE", "0")
        native.load.cache_clear()
        assert native.load("moe") is None and native.unavailable("moe") == "QWEN35_NATIVE=0"
    finally:
        native.load.cache_clear()
        native._REASONS.clear()
