"""Token permutation for the MoE as Pallas TPU kernels (TensorCore, DMA engine): the `permute` slot's "pallas".

Same protocol as `permute.xla`. The index work (a stable argsort of the T*k expert ids, a bincount, the inverse
permutation) stays in XLA: it is O(T*k) int32. The bytes are moved by DMAs that the kernels issue themselves,
one row per DMA, with the source rows named by scalar-prefetched indices:
- dispatch: x_sorted[r] = x[order[r] // k], HBM -> HBM, never staged in VMEM;
- combine: out[t] = sum_j w[t, j] * y_sorted[inv[t*k + j]], rows DMA'd into VMEM, reduced in float32 and written in
  y's dtype (the float32 sums never reach HBM: the caller's cast to the activations' dtype, done in VMEM).
On TPU7x the SparseCores are the natural home of both (tpu-inference's `ragged_gather`/`ragged_gather_reduce`);
these TensorCore versions are the portable form, and what `interpret=True` can check here. The slot registers the
combine with XLA's dispatch (the note at the end: the DMA dispatch's tile view costs a relayout on TPU7x);
`dispatch_pallas` stays for `bench kernels` and its test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35_lib.kernels.moe.pallas import interpret_default, out_struct, run_pallas
from qwen35_lib.kernels.permute.xla import Permute, dispatch_xla
from qwen35_lib.kernels.registry import pallas_interpret, register


def _gather_kernel(src_ref, x_hbm, o_hbm, sem, *, rows: int, n: int):
    """Copy rows [i*rows, (i+1)*rows) of the output (< n) from x[src[r]]: start every DMA, then wait on each."""
    base = pl.program_id(0) * rows
    count = jnp.minimum(rows, n - base)

    def copy(r):  # one token row: a leading-dim index, so whole tiles (a row of a 2D array is not)
        return pltpu.make_async_copy(x_hbm.at[src_ref[base + r]], o_hbm.at[base + r], sem)

    jax.lax.fori_loop(0, count, lambda r, c: (copy(r).start(), c)[1], 0)
    jax.lax.fori_loop(0, count, lambda r, c: (copy(r).wait(), c)[1], 0)


def row_view(D: int) -> tuple[int, int]:
    """[.., D] -> [.., D // 128, 128] when D allows: Mosaic DMAs only whole (8, 128) tiles, so a token's row
    must be a leading-dim index (a 2D array tiles 8 tokens together)."""
    return (D // 128, 128) if D % 128 == 0 else (1, D)


def gather_rows(x: jax.Array, src: jax.Array, *, rows: int = 256, interpret: bool | None = None) -> jax.Array:
    """out[r] = x[src[r]]. x: [T, D], src: [M] int32 (in range) -> [M, D], one DMA per row, `rows` per step.

    On TPU the [T, D] <-> [T, D/128, 128] views are relayout copies (x in, the output out): the price of
    row-granular DMAs on the TensorCore, which a SparseCore gather does not pay."""
    interpret = interpret_default() if interpret is None else interpret
    (T, D), M = x.shape, src.shape[0]
    rows = max(1, min(rows, M))
    args = (src.astype(jnp.int32), x.reshape(T, *row_view(D)))
    make_call = lambda out_shape, interpret: pl.pallas_call(
        functools.partial(_gather_kernel, rows=rows, n=M),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(pl.cdiv(M, rows),), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY), scratch_shapes=[pltpu.SemaphoreType.DMA(())]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )
    out = run_pallas(make_call, out_struct((M, *row_view(D)), x.dtype, *args), interpret, *args)
    return out.reshape(M, D)


def _gather_reduce_kernel(src_ref, w_ref, y_hbm, o_ref, buf, sem, *, tb: int, k: int):
    """Tokens [i*tb, (i+1)*tb): DMA their k rows each into buf [k, tb, R, L], then o = sum_j w[:, j] * buf[j]."""
    base = pl.program_id(0) * tb

    def copies(t):  # token base + t: its k rows, slot j into buf[j, t]
        return [pltpu.make_async_copy(y_hbm.at[src_ref[(base + t) * k + j]], buf.at[j, t], sem) for j in range(k)]

    jax.lax.fori_loop(0, tb, lambda t, c: ([cp.start() for cp in copies(t)], c)[1], 0)
    jax.lax.fori_loop(0, tb, lambda t, c: ([cp.wait() for cp in copies(t)], c)[1], 0)
    w = w_ref[...].astype(buf.dtype).astype(jnp.float32)  # [tb, k]: rounded to y's dtype, as the XLA twin
    _, _, R, L = buf.shape
    acc = jnp.zeros((tb, R * L), jnp.float32)
    for j in range(k):  # static: k is top-k
        acc = acc + w[:, j:j + 1] * buf[j].astype(jnp.float32).reshape(tb, R * L)
    o_ref[...] = acc.astype(o_ref.dtype)  # rounded once, as XLA's convert of the float32 sums would


def gather_reduce(y: jax.Array, src: jax.Array, weights: jax.Array, *, tb: int | None = None,
                  out_dtype=jnp.float32, interpret: bool | None = None) -> jax.Array:
    """out[t] = sum_j weights[t, j] * y[src[t*k + j]]. y: [M, D], src: [T*k], weights: [T, k] -> [T, D] out_dtype.

    1. Pad the tokens to whole blocks of tb (padding tokens read row 0 with weight 0).
    2. Grid over token blocks: each step DMAs its tb*k rows (as [R, L] = `row_view` tiles) into VMEM, reduces them
       in float32 and writes the block in `out_dtype` (bitwise the float32 result cast: one rounding)."""
    interpret = interpret_default() if interpret is None else interpret
    T, k = weights.shape
    M, D = y.shape
    R, L = row_view(D)
    sub = 8 * 4 // jnp.dtype(out_dtype).itemsize  # the output's sublane tile: 8 rows of float32, 16 of bf16
    tb = tb or int(min(64, max(sub, 1 << (T - 1).bit_length())))  # a multiple of the output's sublane tile
    Tp = pl.cdiv(T, tb) * tb
    src = jnp.pad(src.astype(jnp.int32), (0, (Tp - T) * k))
    w = jnp.pad(weights, ((0, Tp - T), (0, 0)))
    args = (src, w, y.reshape(M, R, L))
    make_call = lambda out_shape, interpret: pl.pallas_call(
        functools.partial(_gather_reduce_kernel, tb=tb, k=k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(Tp // tb,),
            in_specs=[pl.BlockSpec((tb, k), lambda i, src: (i, 0)), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((tb, D), lambda i, src: (i, 0)),
            scratch_shapes=[pltpu.VMEM((k, tb, R, L), y.dtype), pltpu.SemaphoreType.DMA(())]),
        out_shape=out_shape,
        # bytes 0: XLA's cost analysis already counts a custom call's operand and result bytes, and adds these
        cost_estimate=pl.CostEstimate(flops=2 * Tp * k * D, transcendentals=0, bytes_accessed=0),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )
    return run_pallas(make_call, out_struct((Tp, D), out_dtype, *args), interpret, *args)[:T]


def dispatch_pallas(x: jax.Array, expert_ids: jax.Array, num_experts: int, *, interpret: bool | None = None):
    """x: [T, D], expert_ids: [T, k] -> (x_sorted [T*k, D], group_sizes [E], order [T*k]), as `dispatch_xla`.

    1. order = stable argsort of the flat ids (copy i is token i // k); group sizes by bincount (XLA).
    2. x_sorted = gather_rows(x, order // k) (Pallas, DMA per row)."""
    T, k = expert_ids.shape
    flat = expert_ids.reshape(T * k)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [T*k]: sorted position -> copy
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    return gather_rows(x, order // k, interpret=interpret), group_sizes, order


def combine_pallas(y_sorted: jax.Array, order: jax.Array, weights: jax.Array, *, interpret: bool | None = None):
    """y_sorted [T*k, D], order [T*k], weights [T, k] -> [T, D] in y_sorted's dtype: `combine_xla`'s float32 sums
    cast to it (the callers cast them to the activations', which the routed rows are).

    1. inv = the inverse permutation (copy -> its sorted row), a scatter of T*k int32 (XLA).
    2. gather_reduce(y_sorted, inv, weights) (Pallas), written in y_sorted's dtype: on TPU7x a float32 [T, D]
       would be written, read and cast in HBM once larger than XLA's scoped VMEM (the 397B mixed step's
       [8704, 4096]: 21.4 GB of its 229 GB besides the Mosaic calls)."""
    n = order.shape[0]
    inv = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))  # [T*k]
    return gather_reduce(y_sorted, inv, weights, out_dtype=y_sorted.dtype, interpret=interpret)


# The slot's "pallas": XLA's sort and gather for the dispatch, the Pallas gather-reduce for the combine. On TPU7x
# the DMA dispatch writes rows as [M, D/128, 128] tiles, which the grouped matmul then needs relaid out to [M, D]
# (a copy: 2 passes over the routed rows), while XLA's gather writes [M, D] at once; the combine reads the
# grouped matmul's output through the same tile view without a copy. The kernels stage's decode at full depth
# (data/aot/hlo/), passes over the routed rows in `parallel.routing.PERMUTE_SCOPE`: 4.6 with the DMA dispatch
# (1.1 + its relayout 2 + the combine 1.2 + the cast 0.3), 8.3 before the routing gathered rows once.
register("permute", "pallas", per_platform=True)(lambda platform: Permute(
    dispatch_xla, functools.partial(combine_pallas, interpret=pallas_interpret(platform))))
