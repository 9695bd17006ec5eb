"""The expert-parallel MoE layer's routed experts as one Pallas TPU kernel: each row tile fetches its routed token
rows itself, runs them through their experts' SwiGLU, and sends every output row home by remote DMA while the next
tiles compute.

Under token replication (`parallel.routing.moe_ep`, routing `replicate`) each device runs its local experts on the
gathered tokens' copies routed to them. The kernels stage writes all N·k copies in expert order (XLA's gather), runs
the grouped matmul over them, sums each token's local copies (a partial sum [N, D]) and reduce-scatters the partial
sums to the tokens' owners after the grouped matmul has finished. Here dispatch and combine are in the matmul kernel
(production's fused EP MoE does both: tpu-inference #3288, #3346):

    recv[owner(t)][(t % n)·k + j] = expert_{ids[t, j]}(x[t])   for every copy (t, j) whose expert is on this device

1. the grid is `moe_pallas`'s over the R = N·k expert-sorted copies (`ffn_call`: visits of (row tile, group), F
   tiles, FP8 dequantized in VMEM), but no sorted copy of x exists: on a tile's first visit its routed rows are
   fetched by one DMA each from the gathered tokens x (`copy` [R]: each sorted row's flat copy index c = t·k + j,
   -1 for rows of other devices' experts, which sort last and are never fetched nor computed);
2. at a row tile's last step its float32 accumulator is rounded into one of two VMEM stages (x's dtype), and one
   remote DMA per routed row starts: stage row -> `recv` row c % n_out on device c // n_out (n_out = n·k); the stage
   is reused two tiles later, after its sends complete, so a tile's transfers run while the next tile computes;
3. a barrier first (no device writes into a peer's `recv` before that peer's kernel has started), and at the last
   step every send is waited for, then every row this device receives (`expect`: its own tokens' copies that route
   somewhere, each one row DMA of the same size).
`recv` [n·k, D/128, 128] holds this device's tokens' copies in copy order; the caller weighs and sums them
(`routing.moe_ep`), in that view. Slots of copies that route nowhere (padding tokens) stay unwritten.

Bytes: HBM, the routed rows read once (N·k/ep a device) and recv written and read, against the kernels stage's N·k
rows written and read around its matmul; ICI, one row per routed copy, N·k/ep rows a device (1.25 N at k = 10 over 8
devices) against the reduce-scatter's (ep-1)/ep·N, in flight behind the matmul (`costmodel.fused_combine`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35_lib.kernels.moe.pallas import REAL, ffn_accumulate, ffn_call, interpret_default, out_struct, run_pallas

COLLECTIVE_ID = 7  # the barrier semaphore's collective id (one per kernel that takes the device barrier)


def _coords(d, sizes: tuple[int, ...]) -> tuple:
    """Flat device index d over mesh axes of `sizes` (major first) -> its mesh coordinates."""
    out = []
    for s in reversed(sizes):
        out.append(d % s)
        d = d // s
    return tuple(reversed(out))


def _fused_kernel(tile_ref, expert_ref, kind_ref, first_ref, start_ref, end_ref, fixed_ref, layer_ref,  # prefetch
                  x_hbm, wg_ref, wu_ref, wd_ref, *rest, tm: int, fp8_block: int | None, k: int, n_out: int,
                  sizes: tuple[int, ...], view: tuple[int, int]):
    """One (visit v, F tile f) step: the tile's rows gathered on its first visit, the grouped FFN
    (`ffn_accumulate`), then the tile's sends (see the module)."""
    del expert_ref, fixed_ref, layer_ref  # used by the index maps only
    if fp8_block:
        sg_ref, su_ref, sd_ref, copy_ref, expect_ref, recv_ref, wg_s, wu_s, wd_s, *rest = rest
        scales, dequantized = (sg_ref, su_ref, sd_ref), (wg_s, wu_s, wd_s)
    else:
        copy_ref, expect_ref, recv_ref, *rest = rest
        scales, dequantized = (), ()
    acc_ref, x_buf, stage_ref, sent_ref, gather_sem, send_sems, recv_sem = rest
    v, f = pl.program_id(0), pl.program_id(1)
    V, nf = pl.num_programs(0), pl.num_programs(1)
    devices = math.prod(sizes)
    tile = tile_ref[v]

    def row_fetch(r, c):  # token row c // k of x -> row r of the tile's buffer
        return pltpu.make_async_copy(x_hbm.at[c // k], x_buf.at[r], gather_sem)

    def row_send(s, r, c):  # stage row (s, r) -> recv row c % n_out of device c // n_out: one [view] row
        return pltpu.make_async_remote_copy(stage_ref.at[s, r], recv_ref.at[c % n_out], send_sems.at[s], recv_sem,
                                           device_id=_coords(c // n_out, sizes),
                                           device_id_type=pl.DeviceIdType.MESH)

    def each_routed_row(fn):  # fn(r, c) for the tile's rows of a local expert; returns how many
        def body(r, count):
            c = copy_ref[tile * tm + r]

            @pl.when(c >= 0)
            def _():
                fn(r, c)

            return count + (c >= 0).astype(jnp.int32)

        return jax.lax.fori_loop(0, tm, body, jnp.int32(0))

    def wait_sends(s):  # every send started from stage s (same-size rows: one wait each)
        jax.lax.fori_loop(0, sent_ref[s], lambda i, c: (row_send(s, 0, 0).wait_send(), c)[1], 0)

    @pl.when((v == 0) & (f == 0))
    def _barrier():  # every device inside the kernel (its recv allocated) before anyone writes into it
        barrier = pltpu.get_barrier_semaphore()
        for d in range(devices):
            pl.semaphore_signal(barrier, device_id=_coords(d, sizes), device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(barrier, devices)
        sent_ref[0] = 0
        sent_ref[1] = 0

    @pl.when((f == 0) & (first_ref[v] == 1) & (kind_ref[v] == REAL))
    def _gather():  # the tile's routed rows from the gathered tokens (other rows stay masked)
        fetched = each_routed_row(lambda r, c: row_fetch(r, c).start())
        jax.lax.fori_loop(0, fetched, lambda i, c: (row_fetch(0, 0).wait(), c)[1], 0)

    last = ffn_accumulate(tile_ref, kind_ref, first_ref, start_ref, end_ref, x_buf, wg_ref, wu_ref, wd_ref, scales,
                          dequantized, acc_ref, tm=tm, fp8_block=fp8_block)

    @pl.when((f == nf - 1) & last)
    def _send():  # the tile is whole: its routed rows leave while the next tiles compute
        s = tile % 2
        wait_sends(s)  # the stage's sends of two tiles ago
        stage_ref[s] = acc_ref[...].astype(stage_ref.dtype).reshape(tm, *view)
        sent_ref[s] = each_routed_row(lambda r, c: row_send(s, r, c).start())

    @pl.when((v == V - 1) & (f == nf - 1))
    def _drain():  # our sends done, then every row of our tokens arrived
        wait_sends(0)
        wait_sends(1)
        jax.lax.fori_loop(0, expect_ref[0], lambda i, c: (row_send(0, 0, 0).wait_recv(), c)[1], 0)


def moe_fused_ep(x, copy, group_sizes, w_gate_up, w_down, fp8_block, k: int, expect, n_out: int,
                 sizes: tuple[int, ...], *, interpret=None, tm: int | None = None, tf: int | None = None):
    """The routed copies of this device's experts through their SwiGLU, each output row sent home by remote DMA.

    x [N, D] the gathered tokens; copy int32 [R = N·k]: the expert-sorted rows, each the flat copy index c = t·k + j
    of a copy routed to a local expert (token t's j-th), -1 past them (rows of other devices' experts, sorted last);
    group_sizes [E] the local experts' rows (their groups first, in order); weights as `moe_pallas` (one layer or
    `LayerOf` stacks, dense or BlockFP8); expect int32 []: rows this device receives; `sizes`: the sizes of the mesh
    axes ('chip', 'core') the shard_map runs over. Copy c goes to device c // n_out, row c % n_out (n_out = n·k, n
    tokens a device). Returns recv [n_out, *view] (x's dtype; view (D/128, 128), or (1, D) where D is not a multiple
    of 128: each row whole tiles, as the DMAs move them; read it in this view, a reshape to [.., D] is a relayout on a
    TPU): unwritten where no copy came. Runs inside `shard_map`;
    off a TPU in the TPU interpreter (remote DMAs and semaphores need it: `pltpu.InterpretParams`).
    1. `ffn_call`'s grid over the R sorted rows (no sorted copy of x is made: a tile's rows are fetched by row DMAs
       from x on its first visit, only the routed ones; other tiles' visits fetch nothing);
    2. the kernel (see the module): barrier, fetch, FFN, sends, drain.
    """
    interpret = interpret_default() if interpret is None else interpret
    if interpret is True:
        interpret = pltpu.InterpretParams()
    N, D = x.shape
    R = copy.shape[0]
    c = ffn_call(jax.ShapeDtypeStruct((R, D), x.dtype), group_sizes, w_gate_up, w_down, fp8_block, None, tm, tf)
    copy = jnp.pad(copy.astype(jnp.int32), (0, c.grid_rows - R), constant_values=-1)  # [T*tm]
    expect = jnp.reshape(expect, (1,)).astype(jnp.int32)
    any_, smem = pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.SMEM)
    scratch = [*c.dequantized, c.acc, pltpu.VMEM((c.tm, *c.view), x.dtype),  # acc, the tile's fetched rows
               pltpu.VMEM((2, c.tm, *c.view), x.dtype), pltpu.SMEM((2,), jnp.int32),  # the stages, their sends
               pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA]
    kernel = functools.partial(_fused_kernel, tm=c.tm, fp8_block=c.fp8_block, k=k, n_out=n_out, sizes=tuple(sizes),
                               view=c.view)
    make_call = lambda out_shape, interpret: pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(c.prefetch), grid=c.grid, in_specs=[any_, *c.in_specs[1:], smem, smem],
            out_specs=any_, scratch_shapes=scratch),
        out_shape=out_shape,
        cost_estimate=c.cost,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=c.vmem_limit, collective_id=COLLECTIVE_ID,
                                             has_side_effects=True),
        interpret=interpret,
    )
    args = (*c.prefetch, x.reshape(N, *c.view), *c.args[1:], copy, expect)
    return run_pallas(make_call, out_struct((n_out, *c.view), x.dtype, *args), interpret, *args)


__all__ = ["COLLECTIVE_ID", "moe_fused_ep"]
