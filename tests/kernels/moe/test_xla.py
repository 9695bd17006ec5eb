"""kernels.moe.xla: every grouped MoE kernel (ragged_dot, capacity and its tiled fallback, the expert loop and its
blocked and fused forms) against per-row math and the dense reference, with empty groups, padding rows and FP8
experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.kernels import get
from qwen35_lib.kernels.moe import xla as moe_xla
from qwen35_lib.kernels.permute.xla import combine_xla, dispatch_xla
from qwen35_lib.model import moe
from qwen35_lib.model.moe import local_moe
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.plan import SINGLE
from qwen35_lib.weights import dequantize_fp8, quantize_fp8

moe_block = jax.jit(lambda cfg, w, x, plan=SINGLE: moe.moe_block(cfg, w, x, parallelism(plan)), static_argnums=(0, 3))


moe_dense_reference = jax.jit(moe.moe_dense_reference, static_argnums=0)


@pytest.mark.parametrize("kernel", ["ragged_dot", "capacity"])
@pytest.mark.parametrize("n", [1, 64, 333])
def test_grouped_moe_matches_dense(tiny_moe, kernel, n):
    cfg, w = tiny_moe
    x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size))
    ref = moe_dense_reference(cfg, w, x)
    out = moe_block(cfg, w, x, SINGLE.replace(moe_kernel=kernel))
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-5)  # float32; only summation order differs


@pytest.mark.parametrize("kernel", ["ragged_dot", "tiled", "capacity"])  # tiled: capacity's fallback, no slot name
# capacity: 20 rows over 6 experts get 16 slots each, so the 17-row group takes the fallback
@pytest.mark.parametrize("sizes", [[0, 5, 0, 0, 9, 1], [3, 2, 0, 4, 1, 5], [0, 17, 0, 0, 1, 0]])
def test_moe_matmul_empty_groups_and_padding_rows(kernel, sizes):
    E, D, F = 6, 16, 8
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    sizes = jnp.array(sizes, jnp.int32)  # sum(sizes) real rows, then padding rows up to 20
    x = jax.random.normal(kx, (20, D))
    wgu = jax.random.normal(kw, (E, D, 2, F))
    wd = jax.random.normal(kd, (E, F, D))
    y = jax.jit(moe_xla.moe_tiled if kernel == "tiled" else get("moe_matmul", kernel))(x, sizes, wgu, wd)
    expert = np.repeat(np.arange(E), np.asarray(sizes))
    for r in range(20):
        if r < int(sizes.sum()):
            h = x[r] @ wgu[expert[r]].reshape(D, 2 * F)
            want = (jax.nn.silu(h[:F]) * h[F:]) @ wd[expert[r]]
        else:
            want = jnp.zeros(D)
        np.testing.assert_allclose(y[r], want, atol=1e-4, rtol=1e-5)


def test_moe_fp8_experts_match_dequantized(tiny_moe):
    cfg, w = tiny_moe
    cfg8 = cfg.replace(expert_dtype="float8_e4m3fn", fp8_block_size=16)
    w8 = dict(w, w_gate_up=quantize_fp8(w["w_gate_up"], 16, (1, 3)), w_down=quantize_fp8(w["w_down"], 16, (1, 2)))
    wdq = dict(w, **{n: dequantize_fp8(w8[n], 16, jnp.float32) for n in ("w_gate_up", "w_down")})
    x = jax.random.normal(jax.random.key(9), (40, cfg.hidden_size))
    for kernel in ("ragged_dot", "capacity"):
        np.testing.assert_allclose(moe_block(cfg8, w8, x, SINGLE.replace(moe_kernel=kernel)), moe_block(cfg, wdq, x),
                                   atol=1e-6, rtol=1e-5)
    xs, sizes = x[:, :16], jnp.array([9, 0, 21, 10], jnp.int32)  # capacity's fallback on sorted rows, FP8 experts
    wgu8 = quantize_fp8(w["w_gate_up"][:4, :16], 16, (1, 3))
    wd8 = quantize_fp8(w["w_down"][:4, :, :16], 16, (1, 2))
    np.testing.assert_allclose(moe_xla.moe_tiled(xs, sizes, wgu8, wd8, 16),
                               moe_xla.moe_ragged_dot(xs, sizes, dequantize_fp8(wgu8, 16, jnp.float32),
                                                      dequantize_fp8(wd8, 16, jnp.float32)), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [40, 333])
def test_fused_loop_matches_dense_and_the_unfused_path(tiny_moe, n):
    # prefill sizes (n * k > 8 E): `routed_experts` runs moe_loop's fused form (dispatch and combine inside)
    cfg, w = tiny_moe
    loop = get("moe_matmul", "loop")
    assert loop.fuses(n * cfg.num_experts_per_tok, cfg.num_experts)
    x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size))
    ref = moe_dense_reference(cfg, w, x)
    np.testing.assert_allclose(moe_block(cfg, w, x, SINGLE.replace(moe_kernel="loop")), ref, atol=1e-6, rtol=1e-5)
    # padding tokens (ids = E) go nowhere; FP8 experts dequantized per expert; the same as dispatch -> loop -> combine
    E = cfg.num_experts
    weights, ids = moe.route(cfg, w["router"], x)
    ids = ids.at[::7].set(E)
    w8 = {n_: quantize_fp8(w[n_], 16, axes) for n_, axes in (("w_gate_up", (1, 3)), ("w_down", (1, 2)))}
    for wgu, wd in ((w["w_gate_up"], w["w_down"]), (w8["w_gate_up"], w8["w_down"])):
        fused = jax.jit(loop.fused, static_argnums=(3, 6))(x, ids, weights, E + 1, wgu, wd, 16)
        xs, gs, order = dispatch_xla(x, ids, E + 1)
        unfused = combine_xla(loop(xs, gs[:E], wgu, wd, 16), order, weights)
        np.testing.assert_allclose(fused, unfused, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["loop tile=None", "loop tile=1", "loop tile=4", "loop tile=4 rows=60",
                                    "blocked block=3 tile=2"])
@pytest.mark.parametrize("sizes", [[0, 5, 0, 0, 9, 1], [3, 2, 0, 4, 1, 5], [0, 17, 0, 0, 1, 0], [0] * 6])
def test_moe_loop_rows_equal_each_rows_expert(kernel, sizes):
    """The expert loop and its blocked form (`moe_loop` runs as `moe_blocked` at decode sizes: tile=None, 20 rows
    over 6 experts): each real row is its own expert's SwiGLU FFN (groups longer than a tile, empty groups, a
    block's padding tiles), padding rows (past the sum of the sizes) are 0."""
    E, D, F = 6, 16, 8
    name, *opts = kernel.split()
    opts = {k: int(v) for k, v in (o.split("=") for o in opts if o != "tile=None")}
    rows = opts.pop("rows", 20)
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    sizes = jnp.array(sizes, jnp.int32)
    x = jax.random.normal(kx, (rows, D))
    wgu, wd = jax.random.normal(kw, (E, D, 2, F)), jax.random.normal(kd, (E, F, D))
    fn = {"loop": moe_xla.moe_loop, "blocked": moe_xla.moe_blocked}[name]
    y = np.asarray(jax.jit(lambda *a: fn(*a, **opts))(x, sizes, wgu, wd))
    expert = np.repeat(np.arange(E), np.asarray(sizes))
    n = int(sizes.sum())
    for r in range(n):
        h = x[r] @ wgu[expert[r]].reshape(D, 2 * F)
        np.testing.assert_allclose(y[r], (jax.nn.silu(h[:F]) * h[F:]) @ wd[expert[r]], atol=1e-4, rtol=1e-5)
    assert not y[n:].any()


@pytest.mark.parametrize("n", [1, 8, 333])  # 1 and 8 tokens (3 and 24 rows over 8 experts): the blocked form
def test_moe_loop_layer_matches_dense_and_capacity(tiny, n):
    cfg, w = tiny
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    moe["router"] = moe["router"] * 50  # sharper routing: some experts get no tokens
    x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size))
    run = jax.jit(lambda c, p, w, x: local_moe(c, w, x, plan=p), static_argnums=(0, 1))
    got = run(cfg, SINGLE.replace(moe_kernel="loop"), moe, x)
    np.testing.assert_allclose(got, moe_dense_reference(cfg, moe, x), atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(got, run(cfg, SINGLE.replace(moe_kernel="capacity"), moe, x), atol=1e-6, rtol=1e-5)


def test_moe_loop_fp8_experts_match_dequantized(tiny):
    cfg, w = tiny
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    cfg8 = cfg.replace(expert_dtype="float8_e4m3fn", fp8_block_size=16)
    loop, ragged_dot = SINGLE.replace(moe_kernel="loop"), SINGLE.replace(moe_kernel="ragged_dot")
    w8 = dict(moe, w_gate_up=quantize_fp8(moe["w_gate_up"], 16, (1, 3)), w_down=quantize_fp8(moe["w_down"], 16, (1, 2)))
    wdq = dict(moe, **{k: dequantize_fp8(w8[k], 16, jnp.float32) for k in ("w_gate_up", "w_down")})
    for n in (40, 8):  # 120 rows over 8 experts: the loop; 24 rows: the blocked form
        x = jax.random.normal(jax.random.key(9), (n, cfg.hidden_size))
        np.testing.assert_allclose(local_moe(cfg8, w8, x, plan=loop), local_moe(cfg, wdq, x, plan=loop),
                                   atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(local_moe(cfg8, w8, x, plan=loop), local_moe(cfg, wdq, x, plan=ragged_dot),
                                   atol=1e-5, rtol=1e-5)
