"""The Pallas MoE kernels (grouped SwiGLU GEMM, permute gather/scatter) against their XLA twins, in interpret
mode, and compiled ahead of time for TPU7x at the 397B shapes.

Tolerances: in float32 the kernel and its twins form the same products and accumulate in float32, only in a
different order, so outputs of size O(1) agree to ~sqrt(K) * 2^-24 (K <= 512): 2e-5 leaves 10x room. In
bfloat16 the SwiGLU product is rounded to bf16 before the down matmul in every implementation; summation
order can flip the rounding of an element of it (2^-8 x |a| ~ 0.2, times |w_down| ~ 0.05: ~4e-5 each;
seen 2e-5 on outputs up to 2): 1e-3 absolute covers a few such flips and nothing larger. The output itself is
rounded to bf16 once in every implementation, so a last-bit difference can also flip it: one bf16 ulp,
at most 2^-7 of the value (`rtol`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.kernels import get
from qwen35_lib.kernels.moe.pallas import moe_pallas, visits
from qwen35_lib.kernels.moe.xla import moe_ragged_dot
from qwen35_lib.kernels.permute.pallas import combine_pallas, dispatch_pallas
from qwen35_lib.kernels.stacked import LayerOf
from qwen35_lib.model import moe
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.plan import SINGLE
from qwen35_lib.weights import BlockFP8, quantize_fp8
from tests import aot_subprocess

E, D, F, N = 6, 256, 256, 120  # small but TPU-shaped (multiples of 128); N is not a multiple of any tile
TOL = {"float32": (2e-5, 2e-5), "bfloat16": (1e-3, 2**-7)}  # (atol, rtol)
pallas = jax.jit(moe_pallas, static_argnames=("fp8_block", "tm", "tf"))


def _weights(dtype="float32", experts=E):
    k1, k2 = jax.random.split(jax.random.key(1))
    wgu = (0.05 * jax.random.normal(k1, (experts, D, 2, F))).astype(dtype)  # [E, D, 2, F]
    wd = (0.05 * jax.random.normal(k2, (experts, F, D))).astype(dtype)  # [E, F, D]
    return wgu, wd


def _reference(x, sizes, wgu, wd, fp8_block=None, group_offset=0):
    """ragged_dot over all groups, then rows outside the local groups [offset, offset + E_local) zeroed."""
    G, El = sizes.shape[0], (wgu.value if isinstance(wgu, BlockFP8) else wgu).shape[0]
    pad = lambda w: jnp.concatenate([jnp.zeros((group_offset,) + w.shape[1:], w.dtype), w,
                                     jnp.zeros((G - group_offset - El,) + w.shape[1:], w.dtype)])
    full = lambda w: BlockFP8(pad(w.value), pad(w.scale)) if isinstance(w, BlockFP8) else pad(w)
    y = moe_ragged_dot(x, sizes, full(wgu), full(wd), fp8_block)  # [N, D], zero weights outside local groups
    ends = np.cumsum(np.asarray(sizes))
    lo = ends[group_offset - 1] if group_offset else 0
    rows = np.arange(x.shape[0])[:, None]
    return jnp.where((rows >= lo) & (rows < ends[group_offset + El - 1]), y, 0.0)


@pytest.mark.parametrize("sizes,dtype,tiles", [
    ([0, 37, 0, 5, 60, 1], "float32", {}),  # empty groups; groups straddling tiles; 17 padding rows
    ([20, 20, 20, 20, 20, 20], "float32", {"tm": 16, "tf": 128}),  # many visits per tile, two F tiles
    ([0, 0, 0, 0, 0, 0], "float32", {}),  # no rows at all: every row is padding
    ([3, 0, 90, 0, 0, 27], "bfloat16", {"tm": 32}),  # bf16; sum == N (no padding)
])
def test_pallas_moe_matches_ragged_dot(sizes, dtype, tiles):
    x = jax.random.normal(jax.random.key(0), (N, D)).astype(dtype)
    sizes = jnp.array(sizes, jnp.int32)
    wgu, wd = _weights(dtype)
    want = _reference(x, sizes, wgu, wd)
    atol, rtol = TOL[dtype]
    assert pallas(x, sizes, wgu, wd, **tiles).dtype == want.dtype == x.dtype  # the slot's protocol
    np.testing.assert_allclose(pallas(x, sizes, wgu, wd, **tiles).astype(np.float32), want.astype(np.float32),
                               atol=atol, rtol=rtol)


def test_pallas_moe_group_offset_and_fused_layout():
    # 9 global groups, 4 local experts (groups 3..6): rows before and after them, and padding rows, give 0.
    # The offset is a traced value, as under shard_map (axis_index * local experts).
    sizes = jnp.array([11, 0, 7, 13, 0, 30, 2, 9, 14], jnp.int32)  # sum 86 of N = 120 rows
    x = jax.random.normal(jax.random.key(2), (N, D))
    wgu, wd = _weights(experts=4)
    want = _reference(x, sizes, wgu, wd, group_offset=3)
    off = jnp.int32(3)
    np.testing.assert_allclose(pallas(x, sizes, wgu, wd, group_offset=off), want, atol=2e-5, rtol=2e-5)
    fused = wgu.reshape(4, D, 2 * F)  # [E, D, 2F]: the layout without a TPU relayout
    np.testing.assert_allclose(pallas(x, sizes, fused, wd, group_offset=off, tm=16), want, atol=2e-5, rtol=2e-5)


def test_pallas_moe_fp8_weights():
    # Block-scaled e4m3 weights (block 128): the kernel dequantizes per block in VMEM into x's dtype, exactly as
    # the twin's `dequantize_fp8` does, so only summation order differs: the float32 tolerance holds.
    sizes = jnp.array([5, 0, 41, 16, 0, 33], jnp.int32)
    x = jax.random.normal(jax.random.key(3), (N, D))
    wgu, wd = _weights()
    q_gu, q_d = quantize_fp8(wgu, 128, (1, 3)), quantize_fp8(wd, 128, (1, 2))
    want = _reference(x, sizes, q_gu, q_d, 128)
    np.testing.assert_allclose(pallas(x, sizes, q_gu, q_d, 128, tf=128), want, atol=2e-5, rtol=2e-5)
    want_local = _reference(x, sizes, BlockFP8(q_gu.value[2:], q_gu.scale[2:]), BlockFP8(q_d.value[2:], q_d.scale[2:]),
                            128, group_offset=2)
    got = pallas(x, sizes, BlockFP8(q_gu.value[2:], q_gu.scale[2:]), BlockFP8(q_d.value[2:], q_d.scale[2:]), 128,
                 group_offset=2)
    np.testing.assert_allclose(got, want_local, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_pallas_moe_reads_a_layer_of_stacked_weights_in_place(fp8):
    # The layer scan hands the kernel the whole stacks [G, P, E, ...] and a (group, position) index (traced, as in
    # the scan); the kernel must compute exactly what it computes on that layer's slice (same tiles, same order).
    G, Pn = 2, 3
    k1, k2 = jax.random.split(jax.random.key(7))
    wgu = 0.05 * jax.random.normal(k1, (G, Pn, 4, D, 2, F))  # [G, P, E, D, 2, F]
    wd = 0.05 * jax.random.normal(k2, (G, Pn, 4, F, D))
    if fp8:
        wgu, wd = quantize_fp8(wgu, 128, (3, 5)), quantize_fp8(wd, 128, (3, 4))
    sizes = jnp.array([11, 0, 7, 13, 0, 30, 2, 9, 14], jnp.int32)
    x = jax.random.normal(jax.random.key(8), (N, D))
    block = 128 if fp8 else None
    run = jax.jit(lambda x, s, a, b, off: moe_pallas(x, s, a, b, block, off, tm=16))
    for g, p in [(1, 2), (0, 1)]:
        layer = jax.tree.map(lambda a, g=g, p=p: a[g, p], (wgu, wd))
        want = run(x, sizes, *layer, jnp.int32(3))
        idx = jnp.array([g, p], jnp.int32)
        got = run(x, sizes, LayerOf(wgu, idx), LayerOf(wd, idx), jnp.int32(3))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(want, _reference(x, sizes, *layer, block, group_offset=3), atol=2e-5, rtol=2e-5)


def test_visits_cover_every_row_once_per_group():
    sizes = jnp.array([0, 37, 0, 5, 60, 1], jnp.int32)
    tile, expert, kind, first, start, end, fixed = map(np.asarray, visits(sizes, None, 6, N, 16))
    assert len(tile) == -(-N // 16) + 6 + 1  # the static bound V = cdiv(N, tm) + E + 1
    assert np.all(np.diff(tile) >= 0) and set(tile) == set(range(-(-N // 16)))  # in order, every tile
    covered = np.zeros(N, int)
    for t, k, s, e in zip(tile, kind, start, end):
        if k == 0:
            covered[max(s, t * 16):min(e, t * 16 + 16)] += 1
    np.testing.assert_array_equal(covered, np.arange(N) < 103)  # real rows once, padding rows never
    assert first.sum() == -(-N // 16)  # one zeroing visit per tile


@pytest.fixture(scope="module")
def tiny_moe():
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    return cfg, jax.tree.map(lambda a: a[0, 0], init_weights(cfg, 3)["layers"]["moe"])


moe_block = jax.jit(lambda cfg, plan, w, x: moe.moe_block(cfg, w, x, parallelism(plan)), static_argnums=(0, 1))
moe_dense_reference = jax.jit(moe.moe_dense_reference, static_argnums=0)


def test_moe_block_with_pallas_kernels_matches_dense(tiny_moe):
    cfg, w = tiny_moe
    x = jax.random.normal(jax.random.key(5), (21, cfg.hidden_size))
    got = moe_block(cfg, SINGLE.replace(moe_kernel="pallas", permute_kernel="pallas"), w, x)
    np.testing.assert_allclose(got, moe_dense_reference(cfg, w, x), atol=1e-6, rtol=1e-5)
    assert get("moe_matmul", "pallas").func is moe_pallas  # interpret mode off a TPU
    assert not get("moe_matmul", "pallas", "tpu").keywords["interpret"]


def test_moe_block_expert_parallel_with_pallas_kernels(tiny_moe):
    # dp8_ep8 + replicate on the 8 CPU devices: each device runs its local experts (the other copies form a trailing
    # group of rows past the sum) inside shard_map (check_vma off: the plain interpreter, see parallel.routing).
    from qwen35_lib.plan import get_layout, make_mesh

    cfg, w = tiny_moe
    x = jax.random.normal(jax.random.key(6), (16, cfg.hidden_size))
    mesh = make_mesh()
    ep = get_layout("dp8_ep8").replace(routing="replicate", moe_kernel="pallas", permute_kernel="pallas")
    with jax.set_mesh(mesh):
        got = moe_block(cfg, ep.bind(mesh, cfg), w, x)
    np.testing.assert_allclose(got, moe_dense_reference(cfg, w, x), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Ahead-of-time compiles for TPU7x at the 397B shapes: hidden 4096, expert FFN 1024, 512 experts of which 64 are
# local under EP 8. Rows per device: a decode step (512 tokens x top-10 / 8 devices) and a prefill chunk
# (8192 tokens x 10 / 8). Real Mosaic lowering: block shapes, VMEM and scalar prefetch are checked for real.
D397, F397, G397, E_LOCAL, BLOCK = 4096, 1024, 512, 64, 128
MOE_CASES = [(640, False), (10240, False), (640, True), (10240, True)]  # (rows, fp8)
# The compiles below run in aot_subprocess's child: libtpu (topology_devices) stays out of the pytest process.


def _abstract():
    from qwen35_lib.aot import topology_devices

    one = jax.sharding.SingleDeviceSharding(topology_devices()[0])
    return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)


def _compile_moe_for_tpu7x(rows: int, fp8: bool) -> int:
    """The compiled kernel's temporary bytes."""
    S = _abstract()
    E, Dm, Fm, b = E_LOCAL, D397, F397, BLOCK
    if fp8:
        wgu = BlockFP8(S((E, Dm, 2 * Fm), jnp.float8_e4m3fn), S((E, Dm // b, 2 * Fm // b), jnp.float32))
        wd = BlockFP8(S((E, Fm, Dm), jnp.float8_e4m3fn), S((E, Fm // b, Dm // b), jnp.float32))
    else:
        wgu, wd = S((E, Dm, 2 * Fm), jnp.bfloat16), S((E, Fm, Dm), jnp.bfloat16)  # gate|up fused: no relayout
    kernel = functools.partial(moe_pallas, fp8_block=b if fp8 else None, interpret=False)
    # as the combine reads y: in its rows' tile view [rows, D/128, 128], the kernel's own output (no relayout)
    fn = jax.jit(lambda *a, **k: kernel(*a, **k).reshape(rows, Dm // 128, 128))
    compiled = fn.lower(S((rows, Dm), jnp.bfloat16), S((G397,), jnp.int32), wgu, wd,
                        group_offset=S((), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _compile_permute_for_tpu7x() -> bool:
    S = _abstract()
    T, k = 512, 10
    dispatch = jax.jit(functools.partial(dispatch_pallas, num_experts=G397, interpret=False))
    dispatch.lower(S((T, D397), jnp.bfloat16), S((T, k), jnp.int32)).compile()
    combine = jax.jit(functools.partial(combine_pallas, interpret=False))
    combine.lower(S((T * k, D397), jnp.bfloat16), S((T * k,), jnp.int32), S((T, k), jnp.bfloat16)).compile()
    return True


def _compile_expert_parallel_for_tpu7x() -> bool:
    # All 512 experts over the 8 TensorCores of a TPU7x-8 (64 each) in shard_map, group_offset from the device's
    # position: the replicated decode step's 5120 sorted copies, of which each device computes its own.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from qwen35_lib.aot import chip_core_mesh, topology_devices

    mesh = chip_core_mesh(topology_devices())
    ep = P(("chip", "core"))

    def body(x, sizes, wgu, wd):
        off = (jax.lax.axis_index("chip") * 2 + jax.lax.axis_index("core")) * E_LOCAL
        return moe_pallas(x, sizes, wgu, wd, group_offset=off, interpret=False)  # partial y per device

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), ep, ep), out_specs=ep)
    S = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    jax.jit(fn).lower(S((5120, D397), jnp.bfloat16, P()), S((G397,), jnp.int32, P()),
                      S((G397, D397, 2 * F397), jnp.bfloat16, ep), S((G397, F397, D397), jnp.bfloat16, ep)).compile()
    return True


def _compile_fused_ep_for_tpu7x() -> dict:
    """The fused EP kernel (`moe_fused_ep`) per device of a TPU7x-8: the replicated decode step's 512 tokens, their
    5120 sorted copies (top-10), 64 local FP8 experts, each routed row fetched and sent home by DMAs: its temporary
    bytes and the collectives XLA adds (none: the kernel moves the rows itself)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from qwen35_lib.aot import chip_core_mesh, topology_devices
    from qwen35_lib.kernels.moe.fused_ep import moe_fused_ep
    from qwen35_lib.parallel import hlo

    mesh = chip_core_mesh(topology_devices())
    ep, b, tokens, k = P(("chip", "core")), BLOCK, 512, 10

    def body(x, copy, sizes, wgu, wd, expect):
        return moe_fused_ep(x, copy[0], sizes, wgu, wd, b, k, expect[0], tokens // 8 * k, (4, 2), interpret=False)[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), ep, P(), ep, ep, ep), out_specs=ep)
    S = lambda shape, dtype, spec=ep: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    wgu = BlockFP8(S((G397, D397, 2, F397), jnp.float8_e4m3fn), S((G397, D397 // b, 2, F397 // b), jnp.float32))
    wd = BlockFP8(S((G397, F397, D397), jnp.float8_e4m3fn), S((G397, F397 // b, D397 // b), jnp.float32))
    compiled = jax.jit(fn).lower(S((tokens, D397), jnp.bfloat16, P()), S((8, tokens * k), jnp.int32),
                                 S((E_LOCAL,), jnp.int32, P()), wgu, wd, S((8,), jnp.int32)).compile()
    return {"temp": compiled.memory_analysis().temp_size_in_bytes,
            "collectives": len(hlo.collectives(compiled.as_text()))}


@pytest.fixture(scope="module")
def tpu7x():
    jobs = {f"moe {rows} {fp8}": (_compile_moe_for_tpu7x, rows, fp8) for rows, fp8 in MOE_CASES}
    return aot_subprocess.run(jobs | {"permute": (_compile_permute_for_tpu7x,),
                                      "expert parallel": (_compile_expert_parallel_for_tpu7x,),
                                      "fused ep": (_compile_fused_ep_for_tpu7x,)})


@pytest.mark.tpu_compile
@pytest.mark.parametrize("rows,fp8", MOE_CASES)
def test_pallas_moe_compiles_for_tpu7x(tpu7x, rows, fp8):
    # nothing weight-sized is materialised: only the expanded FP8 scales (64 x 32 x 2048 x 4 B = 16 MiB)
    assert tpu7x[f"moe {rows} {fp8}"] < 20 * 2**20


@pytest.mark.tpu_compile
def test_pallas_permute_compiles_for_tpu7x(tpu7x):
    assert tpu7x["permute"]  # the dispatch and combine kernels lowered by Mosaic


@pytest.mark.tpu_compile
def test_pallas_moe_expert_parallel_compiles_for_tpu7x(tpu7x):
    assert tpu7x["expert parallel"]


@pytest.mark.tpu_compile
def test_fused_ep_kernel_compiles_for_tpu7x(tpu7x):
    """Mosaic lowers the remote DMAs, semaphores and device barrier; XLA adds no collective (the rows move in the
    kernel); nothing weight-sized materialised (the expanded FP8 scales, 16 MiB, as the plain kernel's)."""
    got = tpu7x["fused ep"]
    assert got["collectives"] == 0 and got["temp"] < 40 * 2**20, got
