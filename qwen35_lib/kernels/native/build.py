"""Native CPU kernels: C++ XLA FFI handlers shipped as source (`kernels/native/*.cc`), compiled on first use with the
machine's C++ compiler and cached, then registered with XLA as custom-call targets for the CPU.

Why: XLA:CPU runs the MoE's few-row expert matmuls at about half the memory bandwidth and copies every gathered
expert before its dot (`moe.xla.moe_loop`); a handler reads the touched experts in place (see `native/moe.cc`). Its
batched matrix-vector products of the GDN decode step are slow too (`native/gdn.cc`).

ISA variants (`ISAS`): one source, built per instruction set with the register blocking chosen for its vector width
and register count (`native/common.h`, `native/gemm.h`): `x86-64-v4` (AVX-512: 32 registers of 16 floats),
`x86-64-v3` (AVX2 + FMA: 16 of 8), `aarch64` (NEON: 32 of 4).
1. The variant: `$QWEN35_NATIVE_ISA` where set (a name of `ISAS`, or an alias: `avx512`, `avx2`, `neon`), else the
   best this CPU runs (`host_isas()`: an AVX-512 machine runs the AVX2 build too, so the benchmarks can measure
   both here). A CPU with none of them (x86-64 without AVX2 and FMA, another architecture), or a variant it cannot
   run, gets None: the XLA kernels run, with a warning that says why. Choose the variant before the first trace:
   the custom-call targets are per variant (`qwen35_moe_grouped_swiglu_x86_64_v3`), traced programs keep theirs.
2. The build: `$CXX` (default `g++`, else `c++`), `-O3 -march=<variant>` (and `-mtune=native` on the machine that
   runs it) against jaxlib's FFI headers, into `$QWEN35_NATIVE_CACHE` (default `~/.cache/qwen35_lib/native`), under
   a name that hashes the source, the flags, the compiler's version, jaxlib's version and this CPU's flags: a new
   source, compiler or CPU builds anew. A build writes a temporary file and renames it, so processes building at
   once (test workers) never see half of it. A variant of another architecture (`aarch64` on x86-64) is built with
   the cross compiler (`aarch64-linux-gnu-g++`) where one is installed: `build_only`, never loaded.
3. The library records its ISA (`qwen35_native_isa()`); `load` checks it is the variant asked for.
- Where no compiler works, `load` returns None and `unavailable(name)` says why; callers fall back to XLA kernels.
- `QWEN35_NATIVE=0` turns native kernels off (the XLA fallbacks run).
- `python -m qwen35_lib.kernels.native [--isa NAME|all]` (`main`) builds them now and says which variant each is.
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
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
# variant -> (its architecture, -march flags, the /proc/cpuinfo flags a CPU must have to run it, what it is)
_V3 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"})
ISAS = {
    "x86-64-v4": ("x86_64", ("-march=x86-64-v4",), _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
                  "AVX-512, 32 registers of 16 floats"),
    "x86-64-v3": ("x86_64", ("-march=x86-64-v3",), _V3, "AVX2 + FMA, 16 registers of 8 floats"),
    "aarch64": ("aarch64", ("-march=armv8-a",), frozenset({"asimd"}), "NEON, 32 registers of 4 floats"),
}
ALIASES = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "neon": "aarch64", "arm64": "aarch64"}
CROSS = {"aarch64": "aarch64-linux-gnu-g++", "x86_64": "x86_64-linux-gnu-g++"}  # compilers for another architecture
_REASONS: dict[str, str] = {}


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


@functools.cache
def host_isas() -> tuple[str, ...]:
    """The variants this CPU runs, best first (empty: none; the XLA kernels run). From /proc/cpuinfo's flags; where
    there is none (macOS), an arm64 machine runs `aarch64` and an x86-64 one what the compiler's `-march=native`
    defines."""
    machine, line = _machine(), _cpu_flags()
    flags = set(line.split(":", 1)[1].split()) if ":" in line else set()
    if not flags and machine == "aarch64":
        flags = {"asimd"}
    if not flags and machine == "x86_64" and (cxx := compiler()):
        defined = subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                                 text=True, timeout=30).stdout
        names = {"__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__BMI__": "bmi1", "__BMI2__": "bmi2",
                 "__F16C__": "f16c", "__MOVBE__": "movbe", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw",
                 "__AVX512CD__": "avx512cd", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl"}
        flags = {flag for macro, flag in names.items() if f"#define {macro} " in defined}
    return tuple(v for v, (arch, _, needs, _) in ISAS.items() if arch == machine and needs <= flags)


def resolve(name: str) -> str:
    """A variant's name from itself or an alias (`avx2` -> `x86-64-v3`); ValueError naming the choices."""
    isa = ALIASES.get(name.strip().lower(), name.strip().lower())
    if isa not in ISAS:
        raise ValueError(f"unknown native ISA {name!r}: choose one of {', '.join(ISAS)} (or {', '.join(ALIASES)})")
    return isa


def isa() -> str | None:
    """The variant the native kernels run as: `$QWEN35_NATIVE_ISA` where set, else the best this CPU runs (None:
    none here, or the one asked for does not run here; `isa_problem()` says why)."""
    return _choice()[0]


def isa_problem() -> str | None:
    """Why `isa()` is None (None where it is not)."""
    return _choice()[1]


def _choice() -> tuple[str | None, str | None]:
    asked, here = os.environ.get("QWEN35_NATIVE_ISA", "").strip(), host_isas()
    if asked:
        try:
            want = resolve(asked)
        except ValueError as e:
            return None, f"QWEN35_NATIVE_ISA: {e}"
        if want not in here:
            return None, (f"QWEN35_NATIVE_ISA={asked}: this CPU ({_machine()}) does not run {want}; it runs "
                          f"{', '.join(here) or 'none of ' + ', '.join(ISAS)}")
        return want, None
    if not here:
        return None, (f"this CPU ({_machine()}) runs none of the native kernels' ISAs ({', '.join(ISAS)}: x86-64 "
                      "with AVX2 and FMA, or AVX-512, or aarch64 NEON)")
    return here[0], None


def describe(variant: str | None = None) -> str:
    """"x86-64-v3 (AVX2 + FMA, 16 registers of 8 floats)" for `variant` (default: `isa()`), or why none runs."""
    variant = variant or isa()
    return f"{variant} ({ISAS[variant][3]})" if variant else f"none ({isa_problem()})"


def compiler(variant: str | None = None) -> str | None:
    """The C++ compiler to build `variant` with (None: none found): for this machine's architecture `$CXX`, else
    `g++`, else `c++`; for another, its cross compiler (`CROSS`)."""
    arch = ISAS[variant][0] if variant else _machine()
    candidates = (os.environ.get("CXX"), "g++", "c++") if arch == _machine() else (CROSS.get(arch),)
    for cxx in candidates:
        if cxx and shutil.which(cxx):
            return cxx
    return None


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen35_lib" / "native"
    return Path(os.environ.get("QWEN35_NATIVE_CACHE", default))


def flags(variant: str | None) -> tuple[str, ...]:
    """The compiler flags of a variant's build (None: `-march=native`, this CPU's own)."""
    if variant is None:
        return (*FLAGS, "-march=native")
    arch, march, _, _ = ISAS[variant]
    return (*FLAGS, *march, *(("-mtune=native",) if arch == _machine() else ()))


def library_path(name: str, cxx: str, variant: str | None = None) -> Path:
    """Where the build of `native/<name>.cc` with `cxx` for `variant` lives in the cache (the name hashes all its
    inputs, the shared headers `native/*.h` included)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]  # what the sources include
    for part in ((SOURCE_DIR / f"{name}.cc").read_bytes(), *headers, " ".join(flags(variant)).encode(),
                 version.encode(), jax.__version__.encode(), _cpu_flags().encode()):
        key.update(part + b"\0")
    return cache_dir() / f"{name}-{variant or 'native'}-{key.hexdigest()[:16]}.so"


def build(name: str, cxx: str, variant: str | None = None) -> Path:
    """Compile `native/<name>.cc` for `variant` into the cache (unless there already); raises `RuntimeError` with
    the compiler's first error line."""
    out = library_path(name, cxx, variant)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags(variant), "-I", jax.ffi.include_dir(), str(SOURCE_DIR / f"{name}.cc"), "-o", tmp]
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


def build_only(name: str, variant: str) -> Path:
    """Build `kernels/native/<name>.cc` for `variant` without loading it (a variant of another architecture: its cross
    compiler); raises `RuntimeError` where no compiler for it is installed or the build fails."""
    cxx = compiler(variant)
    if cxx is None:
        raise RuntimeError(f"no C++ compiler for {variant} (install {CROSS.get(ISAS[variant][0], 'one')})")
    return build(name, cxx, variant)


def load(name: str, variant: str | None = None) -> ctypes.CDLL | None:
    """`kernels/native/<name>.cc` built for `variant` (default: `isa()`; once per machine) and loaded; None where native
    kernels are off or cannot be built or run here (`unavailable(name)` says why, and a warning says it once)."""
    if os.environ.get("QWEN35_NATIVE", "1") == "0":
        _REASONS[name] = "QWEN35_NATIVE=0"
        return None
    return _load(name, variant or isa() or "")


@functools.cache
def _load(name: str, variant: str) -> ctypes.CDLL | None:
    try:
        if not variant:
            raise RuntimeError(isa_problem() or "no native ISA")
        if variant not in host_isas():
            raise RuntimeError(f"this CPU does not run {variant} (it runs {', '.join(host_isas()) or 'none'})")
        cxx = compiler(variant)
        if cxx is None:
            raise RuntimeError("no C++ compiler (set $CXX, or install g++)")
        lib = ctypes.CDLL(str(build(name, cxx, variant)))
        built = lib.qwen35_native_isa
        built.restype = ctypes.c_char_p
        if built().decode() != variant:
            raise RuntimeError(f"{name} built for {variant} reports {built().decode()}")
        return lib
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        _REASONS[name] = str(e)
        warnings.warn(f"native kernel {name} unavailable, the XLA kernel runs instead: {e}", stacklevel=3)
        return None


load.cache_clear = _load.cache_clear  # type: ignore[attr-defined]  (tests start afresh)


def unavailable(name: str) -> str | None:
    """Why `load(name)` returned None (None: it loaded, or was not tried yet)."""
    return _REASONS.get(name)


def ffi_target(name: str, symbol: str) -> str | None:
    """The XLA custom-call target for handler `symbol` of library `name` built for `isa()`, registered for the CPU
    once (None where the library is unavailable): `symbol` and the variant, `qwen35_gdn_decode_x86_64_v3`, so that
    two variants can be registered in one process."""
    lib = load(name)
    return None if lib is None else _register(name, symbol, isa())


@functools.cache
def _register(name: str, symbol: str, variant: str) -> str:
    target = f"{symbol}_{variant.replace('-', '_')}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(load(name, variant), symbol)), platform="cpu")
    return target


def on_cpu(platform: str | None, args: tuple, cpu, default):
    """`cpu(*args)` (a handler's call) where the program is lowered for the CPU, else `default(*args)` (its XLA
    twin). `platform`: the one the plan was bound for (`registry.get`'s factories pass it): the one branch is traced.
    None (unknown: a direct call) traces both and lets the lowering choose (`lax.platform_dependent`); tracing the
    twin too cost the CPU engine's step about a sixth of its trace and compile (the GDN's chunked prefill form)."""
    if platform is None:
        return jax.lax.platform_dependent(*args, cpu=cpu, default=default)
    return cpu(*args) if platform == "cpu" else default(*args)


def main(argv: list[str] | None = None) -> int:
    """Build every native kernel for a variant (`--isa`: default `isa()`; `all`: every one, those of another
    architecture with its cross compiler, not loaded) and say where each went; 1 if one failed."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m qwen35_lib.kernels.native", description=main.__doc__)
    p.add_argument("--isa", help=f"{', '.join(ISAS)}, an alias ({', '.join(ALIASES)}) or all (default: this CPU's)")
    args = p.parse_args(argv)
    variants = list(ISAS) if args.isa == "all" else [resolve(args.isa) if args.isa else isa()]
    print(f"this CPU ({_machine()}) runs: {', '.join(host_isas()) or 'none'}; chosen: {describe()}")
    failed = False
    for variant in variants:
        for source in sorted(SOURCE_DIR.glob("*.cc")):
            try:
                if variant is None:
                    raise RuntimeError(isa_problem())
                if variant in host_isas():
                    if load(source.stem, variant) is None:
                        raise RuntimeError(unavailable(source.stem))
                    where = library_path(source.stem, compiler(variant), variant)
                else:
                    where = f"{build_only(source.stem, variant)} (cross-built, not loaded)"
                print(f"{source.stem} [{variant}]: built, {where}")
            except (RuntimeError, subprocess.SubprocessError) as e:
                failed = True
                print(f"{source.stem} [{variant}]: unavailable: {e}")
    return int(failed)
