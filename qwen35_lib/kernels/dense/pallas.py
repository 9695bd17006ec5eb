"""Dense projections that read one layer of a stacked weight in place: the `dense` slot's "pallas" implementation.

Inside the layer scan a layer's projection weight is a slice `w[g, p]` of its stack [G, P, ...]; XLA's TPU7x
compile copies each group's slice of the stacked projections out before the dots read it, and again where it
rematerializes the slice (`costmodel.compiled.scan_weight_passes`: 3.58 passes over the dense weight bytes a decode
step, where one read is the floor). These kernels take the whole stack as a `kernels.stacked.LayerOf` and
scalar-prefetch the layer's (group, position): every weight BlockSpec indexes [g, p, ...] of the stack, so the
layer's blocks stream from where they lie, once.

Two contractions cover every projection of the model (`model.layer_loop.PROJECTIONS`), each over a stack viewed
[G, P, A, K, N] (A heads of a [K, N] matrix each, the [K, N] blocks tile-aligned):
- in (`contract=1`, x [M, K] -> y [M, A, N]): GDN and attention q / k / v / z / gate [D, A, N], the shared
  expert's gate_up [D, 2, F], and [D, N] (w_b, w_a, the router; A = 1). The [D, A, N] weights are viewed
  [A, D, N]: the order `aot.mxu_format` stores them in (D second-minor, a bitcast there);
- out (`contract=2` over [A, K], x [M, A, K] -> y [M, N]): GDN w_out and attention w_o [A, K, D]; the shared
  expert's down [F, D] (A = 1).

Grid (row tile i, output tile j, reduction step r): y[i, j] accumulates in a float32 VMEM tile over r (K tiles for
`in`, head tiles for `out`) and is rounded into x's dtype (or `dtype`) at the last step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35_lib.kernels.moe.pallas import out_struct, run_pallas
from qwen35_lib.kernels.registry import pallas_interpret, register
from qwen35_lib.kernels.stacked import LayerOf

ROW_TILE = 1024  # rows of x a tile holds: up to here the weight streams once a step
BLOCK_BYTES = 2 * 2**20  # a weight block's bytes (double-buffered by the pipeline: about 4 MiB of VMEM)


def _divisor(n: int, at_most: int, multiple: int = 1) -> int:
    """The largest divisor of n that is <= at_most and a multiple of `multiple` (n itself where none is)."""
    for d in range(min(n, at_most), 0, -1):
        if n % d == 0 and d % multiple == 0:
            return d
    return n


def _kernel(layer_ref, x_ref, w_ref, y_ref, acc_ref, *, heads: int, width: int, per_head: bool):
    """One (row tile, output tile, reduction step): acc += the block's heads' dots; rounded into y at the last step.
    per_head (in): x [tm, tk] @ w[h] [tk, N] into acc [tm, ha*N] at h*N; else (out): x [tm, ha*K] at h*K @ w[h]
    [K, tn], summed into acc [tm, tn]."""
    r = pl.program_id(2)

    @pl.when(r == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    for h in range(heads):
        cols = slice(h * width, (h + 1) * width)
        part = jnp.dot(x if per_head else x[:, cols], w_ref[h].astype(x.dtype), preferred_element_type=jnp.float32)
        if per_head:
            acc_ref[:, cols] += part
        else:
            acc_ref[...] += part

    @pl.when(r == pl.num_programs(2) - 1)
    def _write():
        y_ref[...] = acc_ref[...].astype(y_ref.dtype)


def _rows(x: jax.Array) -> tuple[jax.Array, int, int]:
    """x [M, ...] padded to whole row tiles: (x, tm, tiles), as few tiles of at most ROW_TILE rows as hold M, each
    the same multiple of 16 rows (1,088 rows: two of 544, not two of 1,024 with 960 rows of padding read and
    computed)."""
    M = x.shape[0]
    tiles = -(-M // ROW_TILE)
    tm = -(-M // (16 * tiles)) * 16
    return jnp.pad(x, ((0, tiles * tm - M),) + ((0, 0),) * (x.ndim - 1)), tm, tiles


def _call(kernel, grid, in_specs, out_spec, out_shape, scratch, layer, args, flops, interpret):
    make_call = lambda out, interpret: pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=in_specs,
                                               out_specs=out_spec, scratch_shapes=scratch),
        out_shape=out,
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=0),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=48 * 2**20),
        interpret=interpret,
    )
    return run_pallas(make_call, out_struct(out_shape, args[0].dtype, layer, *args), interpret, layer, *args)


def project_in(x: jax.Array, stack: jax.Array, layer: jax.Array, *, interpret: bool) -> jax.Array:
    """x [M, K] @ stack[g, p] ([G, P, A, K, N], `layer` = (g, p)) -> [M, A*N] in x's dtype (head a's N columns at
    a*N)."""
    M, K = x.shape
    _, _, A, K2, N = stack.shape
    assert K == K2, (x.shape, stack.shape)
    item = stack.dtype.itemsize
    tk = _divisor(K, 512, 128) if K % 128 == 0 else K
    tn = N if N % 128 or tk * N * item <= BLOCK_BYTES else _divisor(N, max(128, BLOCK_BYTES // (tk * item)), 128)
    nt = N // tn  # output tiles a head
    ha = _divisor(A, max(1, BLOCK_BYTES // (tk * N * item))) if nt == 1 else 1
    xp, tm, tiles = _rows(x)
    w_map = lambda i, j, r, layer: (layer[0], layer[1], j // nt, r, j % nt)
    in_specs = [pl.BlockSpec((tm, tk), lambda i, j, r, layer: (i, r)),
                pl.BlockSpec((None, None, ha, tk, tn), w_map)]
    out_spec = pl.BlockSpec((tm, ha * tn), lambda i, j, r, layer: (i, j))
    kernel = functools.partial(_kernel, heads=ha, width=tn, per_head=True)
    y = _call(kernel, (tiles, A // ha * nt, K // tk), in_specs, out_spec, (tiles * tm, A * N),
              [pltpu.VMEM((tm, ha * tn), jnp.float32)], layer, (xp, stack), 2 * M * K * A * N, interpret)
    return y[:M]


def project_out(x: jax.Array, stack: jax.Array, layer: jax.Array, *, interpret: bool) -> jax.Array:
    """x [M, A*K] (head a's K columns at a*K) contracted with stack[g, p] ([G, P, A, K, N]) over (A, K) ->
    [M, N] in x's dtype."""
    M = x.shape[0]
    _, _, A, K, N = stack.shape
    assert x.shape[1] == A * K, (x.shape, stack.shape)
    item = stack.dtype.itemsize
    tn = _divisor(N, 1024, 128) if N % 128 == 0 else N
    ha = _divisor(A, max(1, BLOCK_BYTES // (K * tn * item)))
    xp, tm, tiles = _rows(x)
    w_map = lambda i, j, r, layer: (layer[0], layer[1], r, 0, j)
    in_specs = [pl.BlockSpec((tm, ha * K), lambda i, j, r, layer: (i, r)),
                pl.BlockSpec((None, None, ha, K, tn), w_map)]
    out_spec = pl.BlockSpec((tm, tn), lambda i, j, r, layer: (i, j))
    kernel = functools.partial(_kernel, heads=ha, width=K, per_head=False)
    y = _call(kernel, (tiles, N // tn, A // ha), in_specs, out_spec, (tiles * tm, N),
              [pltpu.VMEM((tm, tn), jnp.float32)], layer, (xp, stack), 2 * M * A * K * N, interpret)
    return y[:M]


def stacked_view(stack: jax.Array, contract: int) -> jax.Array:
    """The [G, P, A, K, N] view `project_in` (contract 1) / `project_out` (contract 2) reads of a stacked
    projection: in [G, P, K, A, N] -> [G, P, A, K, N] (D second-minor, as `aot.mxu_format` stores it), in
    [G, P, K, N] and out [G, P, K, N] -> A = 1, out [G, P, A, K, N] as it is."""
    if stack.ndim == 4:
        return stack[:, :, None]
    if contract == 1:
        return jnp.swapaxes(stack, 2, 3)
    return stack


def stacked_linear(x: jax.Array, w: LayerOf, contract: int = 1, dtype=None, *, interpret: bool) -> jax.Array:
    """`model.layers.linear` on a `LayerOf` view: x [..., in...] @ layer [in..., out...] over x's last `contract`
    dims, float32 accumulation, returned in `dtype` (default: x's). The layer's weight is read in place."""
    lead = x.shape[:x.ndim - contract]
    rows = x.reshape(-1, *x.shape[x.ndim - contract:])  # [M, in...]
    view = stacked_view(w.stack, contract)
    layer = w.index.astype(jnp.int32)
    if contract == 1:
        y = project_in(rows, view, layer, interpret=interpret)  # [M, A*N]
        out = w.stack.shape[3:]
    else:
        y = project_out(rows.reshape(rows.shape[0], -1), view, layer, interpret=interpret)  # [M, N]
        out = w.stack.shape[4:] if w.stack.ndim == 5 else w.stack.shape[3:]
    return y.reshape(*lead, *out).astype(dtype or x.dtype)


@register("dense", "pallas", per_platform=True)
def _dense_pallas(platform: str):
    fn = functools.partial(stacked_linear, interpret=pallas_interpret(platform))
    fn.reads_stacked = True  # takes `LayerOf` views: the layer scan hands it the stacks (model.layer_loop)
    return fn
