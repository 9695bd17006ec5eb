"""Grouped SwiGLU expert FFNs as one Pallas TPU kernel: the `moe_matmul` slot's "pallas" implementation.

Same protocol as `moe.xla` (x_sorted [N, D] sorted by expert, group_sizes, w_gate_up [E, D, 2, F], w_down
[E, F, D], dense or `BlockFP8`; y_sorted [N, D] in x's dtype, 0 for rows of no local expert), plus `group_offset`
for expert parallelism: `group_sizes` [G] counts the rows of G groups in sorted order, the weights hold the
E <= G local experts `group_offset .. group_offset + E - 1`, and rows of every other group give 0 (so can a
trailing group of non-local rows). `w_gate_up` may also come pre-fused as [E, D, 2F] (gate | up columns). The
kernel reads [E, D, 2, F] as its [E, 2, D, F] view: the TPU's default layout of an FP8 [.., D, 2, F] puts the 2
outermost (minor-to-major F, D, 2), so the view is a bitcast (the TPU7x compile of the kernels stage shows no
copy); bf16 [.., D, 2, F] is tiled 2 x 128 over (2, F) (seen for the shared expert), where the view is a
relayout. The weights may also be a `LayerOf` (kernels.stacked): the layer scan's whole stacks [G, P, ...] and
the layer's (group, position), read in place.

The kernel fuses gate, up, SiLU and down: the [rows, F] intermediate never leaves VMEM. Grid (visit v, F tile f):
a visit is one (row tile, group) pair, megablox style, so a row tile that straddles groups is visited once per
group with the other groups' rows masked; `f` walks the expert's FFN dim with y [tm, D] resident in VMEM.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35_lib.kernels.registry import pallas_interpret, register
from qwen35_lib.kernels.stacked import LayerOf
from qwen35_lib.weights import BlockFP8

REAL, DUMMY, NOOP = 0, 1, 2  # visit kinds: a local group's rows; rows of no local expert (zeros); grid padding
VMEM_BYTES = 64 * 2**20  # TPU7x: 64 MiB of VMEM per TensorCore
VMEM_BUDGET = 40 * 2**20  # what tiles may take: the rest is headroom for Mosaic's own temporaries


def interpret_default() -> bool:
    """Pallas TPU kernels run compiled for a TPU and in interpret mode (numerics only) anywhere else."""
    return pallas_interpret()


def out_struct(shape: tuple[int, ...], dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A pallas_call output type that also works inside `shard_map` (check_vma): it varies over every mesh axis
    any input varies over."""
    mats = [jax.typeof(a).manual_axis_type for a in jax.tree.leaves(inputs)]
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))


def run_pallas(make_call, out: jax.ShapeDtypeStruct, interpret, *args):
    """`make_call(out_shape, interpret)(*args)` for a pallas_call, inside `shard_map` (check_vma) too.

    Inside shard_map every input is cast to vary over the mesh axes the output varies over (Pallas wants them to
    agree), and interpret mode becomes TPU interpret mode (`pltpu.InterpretParams`, slower): jax 0.10.2's HLO
    interpreter (`interpret=True`) reads varying scalar-prefetch arrays at invariant grid indices, which check_vma
    rejects. Outside shard_map it is a plain call."""
    axes = out.manual_axis_type.varying
    if not axes:
        return make_call(out, interpret)(*args)
    if interpret is True:
        interpret = pltpu.InterpretParams()

    def cast(a):
        missing = tuple(sorted(axes - jax.typeof(a).manual_axis_type.varying))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return make_call(out, interpret)(*jax.tree.map(cast, args))


def row_tile(n_rows: int, num_groups: int) -> int:
    """Rows per tile tm: about the mean group (rows / groups in `group_sizes`: under expert parallelism the sorted
    rows hold every device's groups), a power of two in [16, 512] (bf16 packs 16 sublanes).

    Smaller tiles waste fewer masked rows where groups straddle tiles; larger ones re-read each expert's
    weights less often (every visit streams the expert's whole F range again) and feed the MXU taller tiles."""
    mean = max(1, n_rows // max(1, num_groups))
    return int(min(512, max(16, 1 << (mean - 1).bit_length())))


def vmem_bytes(tm: int, tf: int, D: int, F: int, x_bytes: int, w_bytes: int, fp8_block: int | None) -> int:
    """VMEM the kernel's blocks take (each input/output block double-buffered by the pipeline)."""
    b = 4 * tm * D * x_bytes + tm * D * 4 + 2 * 3 * D * tf * w_bytes  # x, y, the f32 accumulator, weight tiles
    b += 4 * tm * tf * 4 + tm * D * 4  # gate, up, SiLU product [tm, tf] and the down product [tm, D] (f32)
    if fp8_block:  # expanded scales, and the dequantized tiles in x's dtype
        b += 2 * 2 * (D // fp8_block) * tf * 4 + 2 * (F // fp8_block) * D * 4 + 3 * D * tf * x_bytes
    return b


def ffn_tile(tm: int, D: int, F: int, x_bytes: int, w_bytes: int, fp8_block: int | None) -> int:
    """FFN columns per step tf: the largest divisor of F (a multiple of 128, and of the FP8 block) in budget."""
    step = 128 if not fp8_block else max(128, fp8_block)
    cands = [t for t in range(step, F + 1, step) if F % t == 0] or [F]
    fits = [t for t in cands if vmem_bytes(tm, t, D, F, x_bytes, w_bytes, fp8_block) <= VMEM_BUDGET]
    return max(fits) if fits else min(cands)


def visits(group_sizes: jax.Array, group_offset, num_local: int, n_rows: int, tm: int) -> tuple[jax.Array, ...]:
    """The kernel's visits, as int32 [V] arrays for scalar prefetch; V = cdiv(N, tm) + E + 1 (static bound).

    1. Cut the sorted rows into E + 2 segments: the rows before the local groups, each local group, the rest
       (later groups and padding rows). Segments cover [0, N) in order, so every row tile meets at least one.
    2. A segment visits every row tile it overlaps: visit v -> (tile, segment) by a search over the counts.
       Each segment boundary inside a tile adds one visit, hence the bound. Visits past the count are NOOPs.
    3. Per visit: its tile, kind (REAL for local groups, DUMMY for the others: zero their rows), whether it is
       its tile's first visit (zero the output), its row range, its expert, and for non-REAL visits a fixed F
       tile: pointing their weight blocks at the ones already in VMEM means they fetch no weights.
    """
    G = group_sizes.shape[0]
    E = num_local
    T = pl.cdiv(n_rows, tm)
    V = T + E + 1
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    total = ends[-1]
    off = jnp.clip(jnp.asarray(0 if group_offset is None else group_offset, jnp.int32).reshape(()), 0, G)
    l_end = jax.lax.dynamic_slice(jnp.concatenate([ends, jnp.full((E,), total)]), (off,), (E,))  # [E]
    l_size = jax.lax.dynamic_slice(jnp.concatenate([sizes, jnp.zeros((E,), jnp.int32)]), (off,), (E,))
    l_start = l_end - l_size
    zero = jnp.zeros((1,), jnp.int32)
    seg_start = jnp.concatenate([zero, l_start, l_end[-1:]])  # [S = E + 2]
    seg_end = jnp.concatenate([l_start[:1], l_end, jnp.full((1,), n_rows, jnp.int32)])
    seg_kind = jnp.array([DUMMY] + [REAL] * E + [DUMMY], jnp.int32)
    seg_expert = jnp.concatenate([zero, jnp.arange(E, dtype=jnp.int32), zero])
    first_tile = seg_start // tm
    count = jnp.where(seg_end > seg_start, (seg_end - 1) // tm - first_tile + 1, 0)  # [S] visits per segment
    cum = jnp.cumsum(count)
    v = jnp.arange(V, dtype=jnp.int32)
    valid = v < cum[-1]
    s = jnp.minimum(jnp.searchsorted(cum, v, side="right"), E + 1)  # [V] segment of each visit
    tile = jnp.where(valid, first_tile[s] + v - (cum[s] - count[s]), T - 1)
    kind = jnp.where(valid, seg_kind[s], NOOP)
    real = kind == REAL
    e = jnp.where(real, seg_expert[s], -1)
    prev = jax.lax.cummax(e)  # the latest REAL visit's expert, -1 before the first
    first_real = jnp.min(jnp.where(real, e, E - 1))
    expert = jnp.where(real, e, jnp.where(prev >= 0, prev, first_real))
    fixed_f = jnp.where(real, -1, jnp.where(prev >= 0, -2, 0))  # -1: walk f; -2: the last F tile; 0: the first
    first = jnp.concatenate([jnp.ones((1,), bool), tile[1:] != tile[:-1]]) & (kind != NOOP)
    start = jnp.where(real, seg_start[s], 0)
    end = jnp.where(real, seg_end[s], 0)
    return tuple(a.astype(jnp.int32) for a in (tile, expert, kind, first, start, end, fixed_f))


def _dequantize_into(w_ref, s_ref, out_ref, block: int, s_row0) -> None:
    """out[r] = w[r] * scale[s_row0 + r // block] per block of `block` rows (scales pre-expanded along lanes)."""
    def body(i, carry):
        r = pl.multiple_of(i * block, block)
        w = w_ref[pl.ds(r, block), :].astype(jnp.float32) * s_ref[pl.ds(s_row0 + i, 1), :]
        out_ref[pl.ds(r, block), :] = w.astype(out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, w_ref.shape[0] // block, body, 0)


def ffn_accumulate(tile_ref, kind_ref, first_ref, start_ref, end_ref, x_ref, wg_ref, wu_ref, wd_ref, scales,
                   dequantized, acc_ref, *, tm: int, fp8_block: int | None) -> jax.Array:
    """The steps of one (visit v, F tile f): zero the tile's float32 accumulator on its first visit; for a REAL
    visit acc += mask * (silu(x wg) * (x wu)) wd over this F tile (FP8 tiles dequantized into `dequantized` first).
    Returns whether v is its tile's last visit (the tile's acc is whole after this visit's last F tile)."""
    v, f = pl.program_id(0), pl.program_id(1)
    V = pl.num_programs(0)
    kind = kind_ref[v]
    last = (v == V - 1) | (tile_ref[jnp.minimum(v + 1, V - 1)] != tile_ref[v])  # the tile's last visit

    @pl.when((f == 0) & (first_ref[v] == 1))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(kind == REAL)
    def _compute():
        x = x_ref[...]
        x = x.reshape(x.shape[0], -1)  # [tm, D] (a [tm, D/128, 128] row-tile view too)
        if fp8_block:  # dequantize this step's weight tiles block by block, into x's dtype (as the XLA twin)
            (sg_ref, su_ref, sd_ref), (wg_s, wu_s, wd_s) = scales, dequantized
            _dequantize_into(wg_ref, sg_ref, wg_s, fp8_block, 0)
            _dequantize_into(wu_ref, su_ref, wu_s, fp8_block, 0)
            _dequantize_into(wd_ref, sd_ref, wd_s, fp8_block, f * (wd_ref.shape[0] // fp8_block))
            wg, wu, wd = wg_s[...], wu_s[...], wd_s[...]
        else:
            wg, wu, wd = (r[...].astype(x.dtype) for r in (wg_ref, wu_ref, wd_ref))
        g = jnp.dot(x, wg, preferred_element_type=jnp.float32)  # [tm, tf]
        u = jnp.dot(x, wu, preferred_element_type=jnp.float32)
        rows = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)  # [tm, 1]
        mask = (rows >= start_ref[v]) & (rows < end_ref[v])
        a = jnp.where(mask, jax.nn.silu(g) * u, 0.0).astype(x.dtype)  # other groups' rows contribute nothing
        acc_ref[...] += jnp.dot(a, wd, preferred_element_type=jnp.float32)  # [tm, D]

    return last


def _ffn_kernel(tile_ref, expert_ref, kind_ref, first_ref, start_ref, end_ref, fixed_ref, layer_ref,  # prefetch
                x_ref, wg_ref, wu_ref, wd_ref, *rest, tm: int, fp8_block: int | None):
    """One (visit v, F tile f) step (`ffn_accumulate`); the tile's last step rounds acc (float32, VMEM) into y
    (x's dtype)."""
    del expert_ref, fixed_ref, layer_ref  # used by the index maps only
    if fp8_block:
        sg_ref, su_ref, sd_ref, y_ref, wg_s, wu_s, wd_s, acc_ref = rest
        scales, dequantized = (sg_ref, su_ref, sd_ref), (wg_s, wu_s, wd_s)
    else:
        (y_ref, acc_ref), scales, dequantized = rest, (), ()
    last = ffn_accumulate(tile_ref, kind_ref, first_ref, start_ref, end_ref, x_ref, wg_ref, wu_ref, wd_ref, scales,
                          dequantized, acc_ref, tm=tm, fp8_block=fp8_block)

    @pl.when((pl.program_id(1) == pl.num_programs(1) - 1) & last)
    def _write():
        y_ref[...] = acc_ref[...].astype(y_ref.dtype).reshape(y_ref.shape)  # [tm, D] into the rows' tile view


def moe_pallas(x, group_sizes, w_gate_up, w_down, fp8_block=None, group_offset=None, *, interpret=None,
               tm: int | None = None, tf: int | None = None):
    """Grouped SwiGLU over expert-sorted rows in one fused Pallas TPU kernel.

    The weights may be one layer (`w_gate_up` [E, D, 2, F] or [E, D, 2F], `w_down` [E, F, D]) or a `LayerOf`
    the layer scan passes: the whole stack [G, P, ...] and the layer's (group, position), read in place.
    1. Tiles from shapes: tm = `row_tile` (about the mean group), tf = `ffn_tile` (VMEM budget).
    2. `visits` turns group sizes (and `group_offset`) into visits, scalar-prefetched to SMEM with the
       layer index; every weight BlockSpec indexes [group, position, expert, ...] of the stack (a single layer
       is a stack of one), so no layer slice is copied out of the stack.
    3. x is padded to whole row tiles (interpret mode clamps out-of-bounds blocks instead of masking them);
       w_gate_up [.., D, 2, F] is viewed as [.., 2, D, F] (the TPU's own layout of it: a bitcast), so gate and
       up are two blocks of one array; FP8 scales (1/block^2 of the weight) are taken for the layer and
       repeated along their lane dim so the kernel scales whole rows of a block at once.
    4. The kernel (grid V x F/tf): zero a tile's float32 accumulator on its first visit; for a REAL visit add
       mask * (silu(x wg) * (x wu)) wd for the F tile, FP8 tiles dequantized in VMEM first; round the
       accumulator into the output tile (x's dtype) at the tile's last step.
    """
    interpret = interpret_default() if interpret is None else interpret
    N, D = x.shape
    if N == 0:
        return jnp.zeros((0, D), x.dtype)
    c = ffn_call(x, group_sizes, w_gate_up, w_down, fp8_block, group_offset, tm, tf)
    make_call = lambda out_shape, interpret: pl.pallas_call(
        functools.partial(_ffn_kernel, tm=c.tm, fp8_block=c.fp8_block),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(c.prefetch), grid=c.grid, in_specs=c.in_specs,
            out_specs=pl.BlockSpec((c.tm, *c.view), lambda v, f, tile, *_: (tile[v], 0, 0)),
            scratch_shapes=[*c.dequantized, c.acc]),
        out_shape=out_shape,
        cost_estimate=c.cost,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=c.vmem_limit),
        interpret=interpret,
    )
    T = c.grid_rows // c.tm
    y = run_pallas(make_call, out_struct((T * c.tm, *c.view), x.dtype, *c.prefetch, *c.args), interpret, *c.prefetch,
                   *c.args)
    return y[:N].reshape(N, D)


class FFNCall(NamedTuple):
    """The parts of a grouped-FFN pallas_call (`ffn_call`): scalar-prefetched visits and layer index, the
    inputs (rows x padded to whole tiles, weight and scale blocks), scratch, tiles and estimates."""

    prefetch: tuple  # int32 [V] x 7 (`visits`) and the layer index [2]
    in_specs: list
    args: list  # x [T*tm, D], w_gate (view), w_up (view), w_down[, scales x 3]
    dequantized: list  # FP8: VMEM tiles the weights are dequantized into; else []
    acc: Any  # VMEM [tm, D] float32
    grid: tuple[int, int]  # (V visits, F / tf)
    grid_rows: int  # T * tm
    tm: int
    fp8_block: int | None
    view: tuple[int, int]  # a row's tile view (D / 128, 128), or (1, D)
    cost: Any
    vmem_limit: int


def ffn_call(x, group_sizes, w_gate_up, w_down, fp8_block, group_offset, tm, tf) -> FFNCall:
    """The grouped SwiGLU's pallas_call parts (`moe_pallas` steps 1-3), shared with kernels that extend its steps
    (`moe_fused_ep`)."""
    N, D = x.shape
    if isinstance(w_gate_up, LayerOf) != isinstance(w_down, LayerOf):
        raise TypeError("pallas moe_matmul takes w_gate_up and w_down both as LayerOf views or both as arrays")
    if isinstance(w_gate_up, LayerOf):  # the scan's stacks [G, P, ...] and (group, position)
        layer, gu_stack, d_stack = w_gate_up.index.astype(jnp.int32), w_gate_up.stack, w_down.stack
    else:  # one layer: a stack of one
        layer = jnp.zeros((2,), jnp.int32)
        gu_stack, d_stack = (jax.tree.map(lambda a: a[None, None], w) for w in (w_gate_up, w_down))
    fp8 = isinstance(gu_stack, BlockFP8)
    wgu = gu_stack.value if fp8 else gu_stack  # [G, P, E, D, 2, F] or [G, P, E, D, 2F]
    wd = d_stack.value if fp8 else d_stack  # [G, P, E, F, D]
    E, F = wgu.shape[2], wd.shape[3]
    if fp8 and (D % fp8_block or F % fp8_block):
        raise ValueError(f"pallas moe_matmul needs D={D} and F={F} to be multiples of the FP8 block {fp8_block}")
    split = wgu.ndim == 6
    if split:
        wgu = jnp.swapaxes(wgu, -3, -2)  # [G, P, E, 2, D, F]: gate = [.., 0, :, :], up = [.., 1, :, :]
    x_bytes, w_bytes = x.dtype.itemsize, wgu.dtype.itemsize
    tm = tm or min(row_tile(N, group_sizes.shape[0]), -(-N // 16) * 16)
    tf = tf or ffn_tile(tm, D, F, x_bytes, w_bytes, fp8_block if fp8 else None)
    assert F % tf == 0 and (not fp8 or tf % fp8_block == 0), (F, tf, fp8_block)
    nf = F // tf
    T = pl.cdiv(N, tm)
    prefetch = (*visits(group_sizes, group_offset, E, N, tm), layer)
    # [T*tm, D]; x a ShapeDtypeStruct: a kernel that fetches its rows itself (`moe_fused_ep`) replaces this input
    xp = jnp.pad(x, ((0, T * tm - N), (0, 0))) if isinstance(x, jax.Array) else x

    def f_of(v, f, fixed):  # the F tile a visit's weight blocks point at (see visits)
        fx = fixed[v]
        return jnp.where(fx == -1, f, jnp.where(fx == -2, nf - 1, 0))

    def gate_map(v, f, tile, expert, kind, first, start, end, fixed, layer):
        g, p, e, ft = layer[0], layer[1], expert[v], f_of(v, f, fixed)
        return (g, p, e, 0, 0, ft) if split else (g, p, e, 0, ft)

    def up_map(v, f, tile, expert, kind, first, start, end, fixed, layer):
        g, p, e, ft = layer[0], layer[1], expert[v], f_of(v, f, fixed)
        return (g, p, e, 1, 0, ft) if split else (g, p, e, 0, nf + ft)

    def down_map(v, f, tile, expert, kind, first, start, end, fixed, layer):
        return layer[0], layer[1], expert[v], f_of(v, f, fixed), 0

    def rows_map(v, f, tile, *_):
        return tile[v], 0

    gu_block = (None, None, None, None, D, tf) if split else (None, None, None, D, tf)
    in_specs = [pl.BlockSpec((tm, D), rows_map),
                pl.BlockSpec(gu_block, gate_map),
                pl.BlockSpec(gu_block, up_map),
                pl.BlockSpec((None, None, None, tf, D), down_map)]
    args = [xp, wgu, wgu, wd]
    scratch = [pltpu.VMEM((tm, D), jnp.float32)]  # the accumulator, last
    if fp8:
        b = fp8_block
        g, p = layer[0], layer[1]
        s_gu, s_d = gu_stack.scale[g, p], d_stack.scale[g, p]  # this layer's scales, [E, D/b, 2, F/b], [E, F/b, D/b]
        sgu = jnp.repeat(s_gu.reshape(E, D // b, 2, F // b), b, axis=-1).reshape(E, D // b, 2 * F)
        sd = jnp.repeat(s_d, b, axis=-1)  # [E, F/b, D]
        s_gate = lambda v, f, tile, expert, kind, first, start, end, fixed, layer: (expert[v], 0, f_of(v, f, fixed))
        s_up = lambda v, f, tile, expert, kind, first, start, end, fixed, layer: (expert[v], 0,
                                                                                  nf + f_of(v, f, fixed))
        in_specs += [pl.BlockSpec((None, D // b, tf), s_gate), pl.BlockSpec((None, D // b, tf), s_up),
                     pl.BlockSpec((None, F // b, D), lambda v, f, tile, expert, *_: (expert[v], 0, 0))]
        args += [sgu, sgu, sd]
        scratch = [pltpu.VMEM((D, tf), x.dtype), pltpu.VMEM((D, tf), x.dtype), pltpu.VMEM((tf, D), x.dtype), *scratch]
    # y is written as [rows, D/128, 128] (each row whole 8 x 128 tiles): the view the Pallas combine DMAs rows
    # from (`permute.pallas.row_view`), so the reshape to [N, D] here and back there cancel; written [N, D], XLA
    # relaid the grouped matmul's output out between them every layer (TPU7x, 2 passes over the routed rows)
    view = (D // 128, 128) if D % 128 == 0 else (1, D)
    est = vmem_bytes(tm, tf, D, F, x_bytes, w_bytes, fp8_block if fp8 else None)
    # for XLA's scheduler: each row through its expert once (masked rows of straddled tiles not counted); bytes
    # 0: XLA's cost analysis already counts a custom call's operand and result bytes, and adds these
    cost = pl.CostEstimate(flops=6 * N * D * F, transcendentals=N * F, bytes_accessed=0)
    acc = scratch[-1]
    return FFNCall(prefetch, in_specs, args, scratch[:-1], acc, (prefetch[0].shape[0], nf), T * tm, tm,
                   fp8_block if fp8 else None, view, cost, int(min(VMEM_BYTES, max(32 * 2**20, 1.5 * est))))


moe_pallas.reads_stacked = True  # takes `LayerOf` views: the layer scan hands it the stacks (model.moe)


@register("moe_matmul", "pallas", per_platform=True)
def _moe_pallas_for(platform: str):
    """`moe_pallas` compiled for a TPU, or in interpret mode on another platform."""
    fn = functools.partial(moe_pallas, interpret=pallas_interpret(platform))
    fn.reads_stacked = moe_pallas.reads_stacked
    return fn
