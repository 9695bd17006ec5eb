"""Native CPU kernels: C++ XLA FFI handlers shipped as source (`kernels/*.cc`), compiled on first use with the
machine's C++ compiler and cached, then registered with XLA as custom-call targets for the CPU.

Why: XLA:CPU runs the MoE's few-row expert matmuls at about half the memory bandwidth and copies every gathered
expert before its dot (`moe_xla.moe_loop`); a handler reads the touched experts in place (see `moe_native.cc`). Its
batched matrix-vector products of the GDN decode step are slow too (`gdn_native.cc`).

- The library is built with `$CXX` (default `g++`, else `c++`), `-O3 -march=native` against jaxlib's FFI headers,
  into `$QWEN35_NATIVE_CACHE` (default `~/.cache/qwen35_lib/native`), under a name that hashes the source, the
  flags, the compiler's version, jaxlib's version and this CPU's flags: a new source, compiler or CPU builds anew.
  A build writes a temporary file and renames it, so processes building at once (test workers) never see half of it.
- Where no compiler works, `load` returns None and `unavailable(name)` says why; callers fall back to XLA kernels.
- `QWEN35_NATIVE=0` turns native kernels off (the XLA fallbacks run).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax

SOURCE_DIR = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
_REASONS: dict[str, str] = {}


def compiler() -> str | None:
    """The C++ compiler to build with: `$CXX`, else `g++`, else `c++` (None: none found)."""
    for cxx in (os.environ.get("CXX"), "g++", "c++"):
        if cxx and shutil.which(cxx):
            return cxx
    return None


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen35_lib" / "native"
    return Path(os.environ.get("QWEN35_NATIVE_CACHE", default))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def library_path(name: str, cxx: str) -> Path:
    """Where the build of `kernels/<name>.cc` with `cxx` lives in the cache (the name hashes all its inputs, the
    shared headers `kernels/*.h` included)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]  # what the sources include
    for part in ((SOURCE_DIR / f"{name}.cc").read_bytes(), *headers, " ".join(FLAGS).encode(), version.encode(),
                 jax.__version__.encode(), _cpu_flags().encode()):
        key.update(part + b"\0")
    return cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def build(name: str, cxx: str) -> Path:
    """Compile `kernels/<name>.cc` into the cache (unless there already); raises `RuntimeError` with the compiler's
    first error line."""
    out = library_path(name, cxx)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE_DIR / f"{name}.cc"), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise RuntimeError(f"{cxx} failed on {name}.cc: {(errors or ['no output'])[0].strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """`kernels/<name>.cc` built (once per machine) and loaded; None where native kernels are off or cannot be
    built here (`unavailable(name)` says why, and a warning says it once)."""
    if os.environ.get("QWEN35_NATIVE", "1") == "0":
        _REASONS[name] = "QWEN35_NATIVE=0"
        return None
    cxx = compiler()
    try:
        if cxx is None:
            raise RuntimeError("no C++ compiler (set $CXX, or install g++)")
        return ctypes.CDLL(str(build(name, cxx)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _REASONS[name] = str(e)
        warnings.warn(f"native kernel {name} unavailable, the XLA kernel runs instead: {e}", stacklevel=2)
        return None


def unavailable(name: str) -> str | None:
    """Why `load(name)` returned None (None: it loaded, or was not tried yet)."""
    return _REASONS.get(name)


@functools.cache
def ffi_target(name: str, symbol: str) -> str | None:
    """The XLA custom-call target for handler `symbol` of library `name`, registered for the CPU once (None where
    the library is unavailable)."""
    lib = load(name)
    if lib is None:
        return None
    jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return symbol


def on_cpu(platform: str | None, args: tuple, cpu, default):
    """`cpu(*args)` (a handler's call) where the program is lowered for the CPU, else `default(*args)` (its XLA
    twin). `platform`: the one the plan was bound for (`registry.get`'s factories pass it): the one branch is traced.
    None (unknown: a direct call) traces both and lets the lowering choose (`lax.platform_dependent`); tracing the
    twin too cost the CPU engine's step about a sixth of its trace and compile (the GDN's chunked prefill form)."""
    if platform is None:
        return jax.lax.platform_dependent(*args, cpu=cpu, default=default)
    return cpu(*args) if platform == "cpu" else default(*args)


if __name__ == "__main__":  # python -m qwen35_lib.kernels.native: build every native kernel now
    for source in sorted(SOURCE_DIR.glob("*.cc")):
        built = load(source.stem) is not None
        print(f"{source.stem}: " + (f"built, {library_path(source.stem, compiler())}" if built
                                    else f"unavailable: {unavailable(source.stem)}"))
