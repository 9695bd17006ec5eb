"""kernels.moe.native: the C++ grouped SwiGLU against per-row math (empty groups, padding rows, groups longer than a
work unit, widths that are not whole vectors), in float32 and bfloat16; its fused form (dispatch and combine
inside) against the XLA fused loop; the MoE layer against the dense reference; where it cannot run (FP8 experts,
mixed dtypes) the XLA loop runs instead."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import init_weights
from qwen35_lib.kernels import get, registry
from qwen35_lib.kernels.moe import native as moe_native
from qwen35_lib.kernels.moe import xla as moe_xla
from qwen35_lib.kernels.native import build as native
from qwen35_lib.model import moe
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.plan import SINGLE
from qwen35_lib.weights import quantize_fp8

# Without a C++ compiler the XLA fallback runs (tested with the XLA kernels); with one, a library that does not
# build fails these tests instead of skipping them.
pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler: the native kernel cannot be built")


def test_the_library_builds_and_loads():
    assert native.load(moe_native.LIBRARY) is not None, native.unavailable(moe_native.LIBRARY)
kernel = jax.jit(get("moe_matmul", "native"))


def per_row(x, sizes, wgu, wd):
    """Each row through its expert in float64 (NumPy): rows past the sum of the sizes are 0."""
    x, wgu, wd = (np.asarray(a, np.float64) for a in (x, wgu, wd))
    E, D, _, F = wgu.shape
    expert = np.repeat(np.arange(E), sizes)
    y = np.zeros_like(x)
    for r, e in enumerate(expert):
        h = x[r] @ wgu[e].reshape(D, 2 * F)
        y[r] = (h[:F] / (1 + np.exp(-h[:F])) * h[F:]) @ wd[e]
    return y


@pytest.mark.parametrize("D,F", [(16, 8), (48, 24), (64, 40)])  # 2F and D: whole 16-float vectors or not
@pytest.mark.parametrize("sizes", [[0, 5, 0, 0, 9, 1], [3, 2, 0, 4, 1, 5], [0, 0, 0, 0, 0, 0], [0, 203, 0, 0, 7, 0]])
def test_rows_equal_each_rows_expert(D, F, sizes):
    E, N = 6, max(20, sum(sizes) + 3)  # padding rows after the groups; 203 rows: three work units of one expert
    kx, kw, kd = jax.random.split(jax.random.key(D + sum(sizes)), 3)
    x = jax.random.normal(kx, (N, D))
    wgu = jax.random.normal(kw, (E, D, 2, F)) / np.sqrt(D)
    wd = jax.random.normal(kd, (E, F, D)) / np.sqrt(F)
    y = kernel(x, jnp.array(sizes, jnp.int32), wgu, wd)
    np.testing.assert_allclose(y, per_row(x, sizes, wgu, wd), atol=2e-5, rtol=1e-4)


def test_bfloat16_equals_the_xla_loop():
    """bf16 in and out, float32 accumulation, the activation rounded to bf16 between the matmuls, as `moe_loop`."""
    E, D, F, sizes = 8, 64, 32, [4, 0, 11, 1, 0, 30, 2, 0]
    kx, kw, kd = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (60, D), jnp.bfloat16)
    wgu = (jax.random.normal(kw, (E, D, 2, F)) / 8).astype(jnp.bfloat16)
    wd = (jax.random.normal(kd, (E, F, D)) / 6).astype(jnp.bfloat16)
    sizes = jnp.array(sizes, jnp.int32)
    y, want = kernel(x, sizes, wgu, wd), jax.jit(moe_xla.moe_loop)(x, sizes, wgu, wd)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), atol=0.02, rtol=0.02)
    assert float(jnp.mean((y == want).astype(jnp.float32))) > 0.9  # the same rounding: most outputs bit-equal


def test_the_native_handler_is_what_runs():
    x, sizes = jnp.ones((8, 16)), jnp.array([8, 0], jnp.int32)
    hlo = kernel.lower(x, sizes, jnp.ones((2, 16, 2, 16)), jnp.ones((2, 16, 16))).as_text()
    assert moe_native.HANDLER in hlo


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [1, 8, 130])  # 130 tokens x top-3 over 4 experts: groups past one work unit
def test_fused_equals_the_xla_fused_loop(T, dtype):
    """Dispatch, grouped matmul and combine in one handler, against `moe_loop_fused`; tokens routed nowhere (id E:
    the engine's padding tokens) contribute 0."""
    E, D, F, k = 4, 48, 24, 3
    kx, ki, kw, kg, kd = jax.random.split(jax.random.key(T), 5)
    x = jax.random.normal(kx, (T, D)).astype(dtype)
    ids = jax.random.randint(ki, (T, k), 0, E + 1)  # E: routed nowhere
    weights = jax.random.uniform(kw, (T, k)).astype(dtype)
    wgu = (jax.random.normal(kg, (E, D, 2, F)) / np.sqrt(D)).astype(dtype)
    wd = (jax.random.normal(kd, (E, F, D)) / np.sqrt(F)).astype(dtype)
    run = lambda f: jax.jit(f, static_argnums=3)(x, ids, weights, E + 1, wgu, wd)
    got, want = run(moe_native.moe_native_fused), run(moe_xla.moe_loop_fused)
    assert got.dtype == x.dtype and moe_native.FUSED in jax.jit(moe_native.moe_native_fused, static_argnums=3).lower(
        x, ids, weights, E + 1, wgu, wd).as_text()
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


moe_block = jax.jit(lambda cfg, w, x, plan: moe.moe_block(cfg, w, x, parallelism(plan)), static_argnums=(0, 3))


@pytest.mark.parametrize("n", [1, 8, 333])
def test_moe_layer_matches_dense(tiny_moe, n):
    cfg, w = tiny_moe
    x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size))
    out = moe_block(cfg, w, x, SINGLE.replace(moe_kernel="native"))
    np.testing.assert_allclose(out, jax.jit(moe.moe_dense_reference, static_argnums=0)(cfg, w, x), atol=1e-6,
                               rtol=1e-5)  # float32; only summation order differs


def test_fp8_experts_and_mixed_dtypes_run_the_xla_loop(tiny_moe):
    cfg, w = tiny_moe
    x = jax.random.normal(jax.random.key(2), (40, cfg.hidden_size))
    w8 = dict(w, w_gate_up=quantize_fp8(w["w_gate_up"], 16, (1, 3)), w_down=quantize_fp8(w["w_down"], 16, (1, 2)))
    assert moe_native.native_target(x, w8["w_gate_up"], w8["w_down"]) is None
    assert moe_native.native_target(x.astype(jnp.bfloat16), w["w_gate_up"], w["w_down"]) is None
    assert moe_native.native_target(x, w["w_gate_up"], w["w_down"]).startswith(moe_native.HANDLER)
    cfg8 = cfg.replace(expert_dtype="float8_e4m3fn", fp8_block_size=16)
    np.testing.assert_allclose(moe_block(cfg8, w8, x, SINGLE.replace(moe_kernel="native")),
                               moe_block(cfg8, w8, x, SINGLE.replace(moe_kernel="loop")), atol=1e-6, rtol=1e-5)


def test_the_cpu_default_is_native():
    assert registry.default_name("moe_matmul", "cpu") == SINGLE.kernel("moe_matmul") == "native"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("D,F", [(16, 8), (48, 24), (64, 40)])
def test_packed_experts_give_the_same_bits(D, F, dtype):
    """The handler reading panel-packed stacks (`PanelPacked`, what `prepare_weights` stores on the CPU) equals it
    reading row-major ones, bit for bit: the same products in the same order. Off the handler (here: its target
    made unavailable), the XLA loop runs on the unpacked stacks."""
    E, T, k = 5, 37, 3
    ks = jax.random.split(jax.random.key(D + F), 5)
    x = jax.random.normal(ks[0], (T, D)).astype(dtype)
    ids = jax.random.randint(ks[1], (T, k), 0, E + 1)
    weights = jax.random.uniform(ks[2], (T, k)).astype(dtype)
    wgu = (jax.random.normal(ks[3], (E, D, 2, F)) / np.sqrt(D)).astype(dtype)
    wd = (jax.random.normal(ks[4], (E, F, D)) / np.sqrt(F)).astype(dtype)
    pgu, pd = moe_native.pack_experts(wgu), moe_native.pack_experts(wd)
    fused = jax.jit(moe_native.moe_native_fused, static_argnums=3)
    np.testing.assert_array_equal(fused(x, ids, weights, E + 1, pgu, pd), fused(x, ids, weights, E + 1, wgu, wd))
    sizes = jnp.array([4, 0, 11, 1, 9], jnp.int32)
    xs = x[:28]
    np.testing.assert_array_equal(kernel(xs, sizes, pgu, pd), kernel(xs, sizes, wgu, wd))


def test_packed_experts_off_the_handler_run_the_xla_loop_unpacked(monkeypatch):
    E, D, F, T, k = 4, 16, 8, 9, 2
    ks = jax.random.split(jax.random.key(0), 5)
    x, ids = jax.random.normal(ks[0], (T, D)), jax.random.randint(ks[1], (T, k), 0, E)
    weights = jax.random.uniform(ks[2], (T, k))
    wgu, wd = jax.random.normal(ks[3], (E, D, 2, F)), jax.random.normal(ks[4], (E, F, D))
    monkeypatch.setattr(moe_native.build, "ffi_target", lambda *a: None)
    assert moe_native.native_target(x, wgu, wd) is None
    got = moe_native.moe_native_fused(x, ids, weights, E, moe_native.pack_experts(wgu), moe_native.pack_experts(wd))
    np.testing.assert_allclose(got, moe_xla.moe_loop_fused(x, ids, weights, E, wgu, wd), atol=1e-5, rtol=1e-5)
    sizes = jnp.array([5, 0, 9, 4], jnp.int32)
    x18 = jax.random.normal(ks[0], (18, D))
    got = moe_native.moe_native(x18, sizes, moe_native.pack_experts(wgu), moe_native.pack_experts(wd))
    np.testing.assert_allclose(got, moe_xla.moe_loop(x18, sizes, wgu, wd), atol=1e-5, rtol=1e-5)


def test_prepare_weights_packs_the_cpu_experts(tiny_moe):
    """On the CPU with the native kernel, the per-layer routed expert stacks are `PanelPacked` (the weight check
    reads their logical shapes); under another MoE kernel they stay arrays; FP8 stacks are never packed."""
    from qwen35_lib.model import decoder, layer_loop

    cfg, _ = tiny_moe
    w = init_weights(cfg, 0)
    prepared = layer_loop.prepare_weights(cfg, w)
    lw = prepared["layers"][0][0]
    assert all(isinstance(lw.moe[n], moe_native.PanelPacked) for n in ("w_gate_up", "w_down"))
    assert lw.moe["w_gate_up"].shape == w["layers"]["moe"]["w_gate_up"].shape[2:]
    decoder.check_weights(cfg, prepared)
    loop = SINGLE.replace(moe_kernel="loop")
    plain = layer_loop.prepare_weights(cfg, w, loop)
    assert isinstance(plain["layers"][0][0].moe["w_gate_up"], jax.Array)
    assert layer_loop.prepare_weights(cfg, w, loop)["layers"] is plain["layers"]  # split once per kernel choice
    assert layer_loop.prepare_weights(cfg, w)["layers"] is prepared["layers"]
    fp8 = quantize_fp8(w["layers"]["moe"]["w_gate_up"][0, 0], 16, (1, 3))
    assert moe_native.moe_native.pack(fp8) is fp8
