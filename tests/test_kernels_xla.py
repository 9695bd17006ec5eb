"""The XLA kernels against their twins: chunked vs recurrent GDN, grouped MoE vs dense, permute round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.kernels import available, gdn_xla, get
from qwen35_lib.kernels.permute_xla import combine_xla, dispatch_xla
from qwen35_lib.model import moe
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.plan import SINGLE
from qwen35_lib.weights import BlockFP8, dequantize_fp8, quantize_fp8

# jitted once per shape: eager op-by-op dispatch would dominate the test time
gdn_recurrent = jax.jit(gdn_xla.gdn_recurrent)
gdn_chunked = jax.jit(gdn_xla.gdn_chunked, static_argnames="chunk_size")
moe_block = jax.jit(lambda cfg, w, x, plan=SINGLE: moe.moe_block(cfg, w, x, parallelism(plan)), static_argnums=(0, 3))
moe_dense_reference = jax.jit(moe.moe_dense_reference, static_argnums=0)


def _gdn_inputs(key, B, T, Hk, Hv, dk, dv):
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, Hk, dk))
    k = jax.random.normal(ks[1], (B, T, Hk, dk))
    v = jax.random.normal(ks[2], (B, T, Hv, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, Hv)))  # log decay <= 0
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, Hv)))
    state = 0.1 * jax.random.normal(ks[5], (B, Hv, dk, dv))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 64, 150])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])  # (key heads, value heads): GVA when they differ
def test_gdn_chunked_matches_recurrent(T, heads):
    # float32 end to end; the two forms reorder sums over up to T tokens, so 1e-5 relative to O(1) values.
    inputs = _gdn_inputs(jax.random.key(T), 2, T, *heads, 16, 24)
    o_r, s_r = gdn_recurrent(*inputs)
    o_c, s_c = gdn_chunked(*inputs, chunk_size=64)
    np.testing.assert_allclose(o_c, o_r, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s_c, s_r, atol=1e-5, rtol=1e-5)


def test_gdn_chunked_continues_from_state():
    # Splitting a sequence at a non-chunk boundary and carrying the state gives the same outputs.
    q, k, v, g, beta, s0 = _gdn_inputs(jax.random.key(1), 1, 100, 2, 4, 16, 24)
    o_full, s_full = gdn_chunked(q, k, v, g, beta, s0)
    cut = 37
    o1, s1 = gdn_chunked(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], s0)
    o2, s2 = gdn_chunked(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), o_full, atol=1e-5)
    np.testing.assert_allclose(s2, s_full, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_moe():
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = jax.tree.map(lambda a: a[0, 0], init_weights(cfg, 3)["layers"]["moe"])
    w["router"] = w["router"] * 50  # sharper routing: some experts get no tokens
    return cfg, w


@pytest.mark.parametrize("kernel", ["ragged_dot", "tiled", "capacity"])
@pytest.mark.parametrize("n", [1, 64, 333])
def test_grouped_moe_matches_dense(tiny_moe, kernel, n):
    cfg, w = tiny_moe
    x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size))
    ref = moe_dense_reference(cfg, w, x)
    out = moe_block(cfg, w, x, SINGLE.replace(moe_kernel=kernel))
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-5)  # float32; only summation order differs


@pytest.mark.parametrize("kernel", ["ragged_dot", "tiled", "capacity"])
# capacity: 20 rows over 6 experts get 16 slots each, so the 17-row group takes the fallback
@pytest.mark.parametrize("sizes", [[0, 5, 0, 0, 9, 1], [3, 2, 0, 4, 1, 5], [0, 17, 0, 0, 1, 0]])
def test_moe_matmul_empty_groups_and_padding_rows(kernel, sizes):
    E, D, F = 6, 16, 8
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    sizes = jnp.array(sizes, jnp.int32)  # sum(sizes) real rows, then padding rows up to 20
    x = jax.random.normal(kx, (20, D))
    wgu = jax.random.normal(kw, (E, D, 2, F))
    wd = jax.random.normal(kd, (E, F, D))
    y = jax.jit(get("moe_matmul", kernel))(x, sizes, wgu, wd)
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
    for kernel in ("ragged_dot", "tiled", "capacity"):
        np.testing.assert_allclose(moe_block(cfg8, w8, x, SINGLE.replace(moe_kernel=kernel)), moe_block(cfg, wdq, x),
                                   atol=1e-6, rtol=1e-5)


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


def test_fp8_quantize_roundtrip_error_is_e4m3_sized():
    w = jax.random.normal(jax.random.key(0), (3, 40, 2, 24))  # partial blocks on both blocked dims
    q = quantize_fp8(w, 16, (1, 3))
    assert isinstance(q, BlockFP8) and q.value.dtype == jnp.float8_e4m3fn and q.scale.shape == (3, 3, 2, 2)
    err = jnp.abs(dequantize_fp8(q, 16, jnp.float32) - w) / (jnp.abs(w) + 1e-3)
    assert float(jnp.median(err)) < 2**-4  # e4m3 keeps 3 mantissa bits: relative step 2^-3, rounding half that


def test_permute_roundtrip():
    permute = get("permute", "xla")
    x = jax.random.normal(jax.random.key(0), (7, 5))
    ids = jax.random.randint(jax.random.key(1), (7, 3), 0, 4)
    xs, sizes, order = permute.dispatch(x, ids, 4)
    assert int(sizes.sum()) == 21 and bool(jnp.all(jnp.diff(ids.reshape(-1)[order]) >= 0))
    w = jnp.ones((7, 3)) / 3
    np.testing.assert_allclose(permute.combine(xs, order, w), x, atol=1e-6)


def test_registry_lists_and_rejects():
    assert {"xla"} <= set(available("attention")) and {"ragged_dot", "tiled"} <= set(available("moe_matmul"))
    with pytest.raises(ValueError, match="no 'moe_matmul' kernel named 'nope'; available"):
        get("moe_matmul", "nope")
    with pytest.raises(ValueError, match="unknown kernel slot"):
        get("flash", "xla")
