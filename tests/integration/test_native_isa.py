"""`native.build`'s ISA variants: which ones a CPU runs (from its flags), which one runs (`QWEN35_NATIVE_ISA` or the
best), a CPU or a request the kernels do not serve falling back to XLA with a warning; and every variant this CPU
runs (an AVX-512 machine runs the AVX2 build too) checked against the XLA twins: the grouped SwiGLU (sorted and
fused, float32 and bfloat16, row-major and packed; row counts that take every register block, widths that are not
whole vectors), the GDN decode and prefill steps, the dense rows handler; the variants' float32 matmuls equal bit
for bit (the same products added in the same order, whatever the block); the aarch64 build compiles where a cross
compiler is installed, and its inner loops pass `native_check.cc` under qemu-aarch64 where that is installed too."""

import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.bench.kernels_gdn import random_gdn_inputs
from qwen35_lib.kernels.dense import native as dense_native
from qwen35_lib.kernels.gdn import native as gdn_native
from qwen35_lib.kernels.gdn import xla as gdn_xla
from qwen35_lib.kernels.moe import native as moe_native
from qwen35_lib.kernels.moe import xla as moe_xla
from qwen35_lib.kernels.native import build as native

AVX512 = "flags\t\t: fpu sse sse2 avx avx2 fma bmi1 bmi2 f16c movbe avx512f avx512bw avx512cd avx512dq avx512vl\n"
AVX2 = "flags\t\t: fpu sse sse2 avx avx2 fma bmi1 bmi2 f16c movbe\n"
SSE = "flags\t\t: fpu sse sse2 sse4_2\n"
NEON = "Features\t: fp asimd evtstrm aes crc32\n"


@pytest.fixture
def fresh(monkeypatch):
    """native's caches emptied before and after (a test that fakes the CPU must not leave it behind)."""
    native.host_isas.cache_clear()
    native.load.cache_clear()
    native._REASONS.clear()
    yield monkeypatch
    native.host_isas.cache_clear()
    native.load.cache_clear()
    native._REASONS.clear()


@pytest.mark.parametrize("machine,cpuinfo,want", [
    ("x86_64", AVX512, ("x86-64-v4", "x86-64-v3")), ("x86_64", AVX2, ("x86-64-v3",)), ("x86_64", SSE, ()),
    ("aarch64", NEON, ("aarch64",)), ("riscv64", "isa\t\t: rv64imafdc\n", ())])
def test_the_variants_a_cpu_runs_come_from_its_flags(fresh, machine, cpuinfo, want):
    fresh.setattr(native, "_machine", lambda: machine)
    fresh.setattr(native, "_cpu_flags", lambda: next(iter(cpuinfo.splitlines(True)), ""))
    fresh.delenv("QWEN35_NATIVE_ISA", raising=False)
    assert native.host_isas() == want
    assert native.isa() == (want[0] if want else None)
    if not want:
        assert "runs none of the native kernels' ISAs" in native.isa_problem()


def test_the_variant_is_chosen_by_the_environment(fresh):
    fresh.setattr(native, "_machine", lambda: "x86_64")
    fresh.setattr(native, "_cpu_flags", lambda: AVX512)
    fresh.setenv("QWEN35_NATIVE_ISA", "avx2")
    assert native.isa() == "x86-64-v3" and native.describe().startswith("x86-64-v3 (AVX2")
    fresh.setenv("QWEN35_NATIVE_ISA", "neon")
    assert native.isa() is None and "does not run aarch64" in native.isa_problem()
    fresh.setenv("QWEN35_NATIVE_ISA", "sse9")
    assert native.isa() is None and "unknown native ISA 'sse9'" in native.isa_problem()


def test_a_cpu_the_kernels_do_not_serve_runs_the_xla_kernels_with_a_warning(fresh):
    """x86-64 without AVX2: no variant, a warning saying so, and the MoE still runs (the XLA loop)."""
    fresh.setattr(native, "_machine", lambda: "x86_64")
    fresh.setattr(native, "_cpu_flags", lambda: SSE)
    fresh.delenv("QWEN35_NATIVE_ISA", raising=False)
    jax.clear_caches()
    try:
        with pytest.warns(UserWarning, match="runs none of the native kernels' ISAs"):
            assert native.load(moe_native.LIBRARY) is None
        x, sizes, wgu, wd = _moe_operands(jnp.float32, [3, 0, 5])
        got = jax.jit(moe_native.moe_native)(x, sizes, wgu, wd)
        assert moe_native.HANDLER not in jax.jit(moe_native.moe_native).lower(x, sizes, wgu, wd).as_text()
        np.testing.assert_allclose(got, jax.jit(moe_xla.moe_loop)(x, sizes, wgu, wd), atol=1e-6, rtol=1e-6)
    finally:
        jax.clear_caches()


@pytest.fixture(params=native.host_isas() or [None])
def variant(request, monkeypatch):
    """Each variant this CPU runs, chosen by `QWEN35_NATIVE_ISA` (traced programs cleared around it)."""
    if request.param is None or native.compiler() is None:
        pytest.skip("no native variant runs here (or no C++ compiler)")
    monkeypatch.setenv("QWEN35_NATIVE_ISA", request.param)
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def test_each_variant_records_its_isa(variant):
    for name in (moe_native.LIBRARY, gdn_native.LIBRARY, dense_native.LIBRARY):
        lib = native.load(name)
        assert lib is not None, native.unavailable(name)
        assert lib.qwen35_native_isa().decode() == variant  # restype set by load
    target = native.ffi_target(moe_native.LIBRARY, moe_native.HANDLER)
    assert target == f"{moe_native.HANDLER}_{variant.replace('-', '_')}"


# 1-7 rows: every register block (1 row, 2 rows, 3-6 rows, 6 + 1); 13: two blocks and a remainder; 100: past a
# work unit (96 rows) and past kRows at every depth; an empty group
SIZES = [1, 2, 3, 4, 5, 6, 7, 13, 0, 100]


def _moe_operands(dtype, sizes, D=72, F=36):
    """x [N, D] sorted by expert, group sizes, w_gate_up [E, D, 2, F], w_down [E, F, D]; D = 2F = 72: a 64-column
    panel and 8 more (whole AVX2 vectors, not whole AVX-512 ones: the scalar loop there)."""
    E, N = len(sizes), sum(sizes) + 3  # 3 padding rows
    kx, kw, kd = jax.random.split(jax.random.key(len(sizes)), 3)
    x = jax.random.normal(kx, (N, D)).astype(dtype)
    wgu = (jax.random.normal(kw, (E, D, 2, F)) / np.sqrt(D)).astype(dtype)
    wd = (jax.random.normal(kd, (E, F, D)) / np.sqrt(F)).astype(dtype)
    return x, jnp.array(sizes, jnp.int32), wgu, wd


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True])
def test_each_variant_grouped_swiglu_equals_the_xla_loop(variant, dtype, packed):
    x, sizes, wgu, wd = _moe_operands(jnp.dtype(dtype), SIZES)
    ws = (moe_native.pack_experts(wgu), moe_native.pack_experts(wd)) if packed else (wgu, wd)
    fn = jax.jit(moe_native.moe_native)
    assert f"{moe_native.HANDLER}_{variant.replace('-', '_')}" in fn.lower(x, sizes, *ws).as_text()
    got, want = fn(x, sizes, *ws), jax.jit(moe_xla.moe_loop)(x, sizes, wgu, wd)
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("T", [1, 8, 130])
def test_each_variant_fused_equals_the_xla_fused_loop(variant, T):
    E, D, k = 5, 72, 3
    _, _, wgu, wd = _moe_operands(jnp.float32, [0] * E, D=D)
    kx, ki, kg = jax.random.split(jax.random.key(T), 3)
    x = jax.random.normal(kx, (T, D))
    ids = jax.random.randint(ki, (T, k), 0, E + 1)  # E: routed nowhere
    weights = jax.nn.softmax(jax.random.normal(kg, (T, k)))
    got = jax.jit(moe_native.moe_native_fused, static_argnums=3)(x, ids, weights, E, wgu, wd)
    want = jax.jit(moe_xla.moe_loop_fused, static_argnums=3)(x, ids, weights, E, wgu, wd)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_the_variants_matmuls_equal_bit_for_bit(variant):
    """float32: each output is the same FMAs over k in the same order in every register block, so the AVX2 build
    and the AVX-512 one give the same bits (checked where both run: against the first variant's result). Widths
    of whole vectors on every ISA (D = 80, F = 48: the vectorised exp too; a scalar tail rounds otherwise)."""
    x, sizes, wgu, wd = _moe_operands(jnp.float32, SIZES, D=80, F=48)
    got = np.asarray(jax.jit(moe_native.moe_native)(x, sizes, moe_native.pack_experts(wgu),
                                                    moe_native.pack_experts(wd)))
    first = _FIRST.setdefault("moe", (variant, got))
    if first[0] != variant:
        np.testing.assert_array_equal(got, first[1])


_FIRST: dict = {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
def test_each_variant_dense_rows_equal_xlas_dot(variant, rows, dtype):
    K, N = 96, 192  # 3 panels (pack_dense packs whole panels only)
    kx, kw = jax.random.split(jax.random.key(rows))
    w = (jax.random.normal(kw, (K, N)) / 8).astype(dtype)
    x = jax.random.normal(kx, (rows, K)).astype(dtype)
    p = dense_native.pack_dense(w)
    fn = jax.jit(dense_native.linear_packed)
    assert f"{dense_native.HANDLER}_{variant.replace('-', '_')}" in fn.lower(x, p).as_text()
    want = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)
    tol = 1e-5 if dtype == "float32" else 2**-7
    np.testing.assert_allclose(np.asarray(fn(x, p), np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("dv", [64, 40])  # whole vectors of every ISA (column blocks), or not (AVX-512: scalar)
def test_each_variant_gdn_decode_and_prefill_equal_the_xla_forms(variant, dv):
    heads = dict(Hk=2, Hv=4, dk=32, dv=dv)
    D, NS = 5, 7
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(dv), (D,), **heads, dtype=jnp.float32)
    states = jax.random.normal(jax.random.key(1), (NS, 4, 32, dv)) / 4
    slot = jnp.array([3, 1, -1, 6, 2], jnp.int32)
    start = jnp.array([True, False, True, True, True])
    fn = jax.jit(gdn_native.gdn_decode_native)
    assert f"{gdn_native.HANDLER}_{variant.replace('-', '_')}" in fn.lower(q, k, v, g, beta, slot, start,
                                                                          states).as_text()
    o, s = fn(q, k, v, g, beta, slot, start, states)
    want_o, want_s = jax.jit(gdn_xla.gdn_decode_xla)(q, k, v, g, beta, slot, start, states)
    real = np.asarray(slot) >= 0  # padding rows: both from zero; the XLA form writes the null slot, ours nothing
    np.testing.assert_allclose(np.asarray(o)[real], np.asarray(want_o)[real], atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(s)[1:], np.asarray(want_s)[1:], atol=1e-5, rtol=1e-4)
    # prefill: 2 sequences of 6 tokens from zero, the dense form against XLA's chunked one
    q, k, v, g, beta = random_gdn_inputs(jax.random.key(2), (2, 6), **heads, dtype=jnp.float32)
    s0 = jnp.zeros((2, 4, 32, dv))
    o, S = jax.jit(gdn_native.gdn_dense_native)(q, k, v, g, beta, s0)
    want_o, want_S = jax.jit(gdn_xla.gdn_xla)(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o, want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(S, want_S, atol=2e-5, rtol=1e-4)


CHECK = pathlib.Path(__file__).with_name("native_check.cc")
EMULATOR = {"aarch64": "qemu-aarch64"}  # apt-get install qemu-user


def _runnable_checks():
    """(variant, how to run a program built for it): this CPU's variants natively, aarch64 under qemu where its
    cross compiler and qemu are installed."""
    out = [(v, ()) for v in native.host_isas()]
    for v, emulator in EMULATOR.items():
        if v not in native.host_isas() and native.compiler(v) and shutil.which(emulator):
            out.append((v, (emulator,)))
    return out or [(None, ())]


def _id(x) -> str:
    return (" ".join(x) or "natively") if isinstance(x, tuple) else str(x)


@pytest.mark.parametrize("variant,runner", _runnable_checks(), ids=_id)
@pytest.mark.parametrize("which", ["moe", "gdn"])
def test_each_variants_inner_loops_as_a_program(tmp_path, variant, runner, which):
    """native_check.cc, built for the variant (statically, with its flags) and run (aarch64 under qemu-aarch64):
    the matmul's register blocks and the exp (moe), the GDN update's column blocks (gdn) against double precision."""
    if variant is None or native.compiler(variant) is None:
        pytest.skip("no variant to build a check program for here")
    exe = tmp_path / f"check_{which}"
    cmd = [native.compiler(variant), *[f for f in native.flags(variant) if f not in ("-shared", "-fPIC")], "-static",
           *(["-DCHECK_GDN"] if which == "gdn" else []), "-I", str(native.SOURCE_DIR), "-I", jax.ffi.include_dir(),
           str(CHECK), "-o", str(exe)]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    done = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == f"{variant} ok", done.stdout + done.stderr


@pytest.mark.skipif(native._machine() == "aarch64" or native.compiler("aarch64") is None,
                    reason="no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
def test_the_aarch64_build_compiles():
    """Every kernel cross-compiles for aarch64 NEON (into the cache; not loaded here) and records its ISA."""
    for source in sorted(native.SOURCE_DIR.glob("*.cc")):
        lib = native.build_only(source.stem, "aarch64")
        assert lib.exists() and b"aarch64" in lib.read_bytes()
