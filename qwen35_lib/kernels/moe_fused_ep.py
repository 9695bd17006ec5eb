"""The expert-parallel MoE's grouped SwiGLU with its combine fused in: one Pallas TPU kernel that sends each routed
row home by remote DMA as soon as its row tile is done, overlapped with the next tiles' matmuls.

Under token replication (`parallel.routing.moe_ep`, routing `replicate`) each device runs its local experts on the
gathered copies routed to them; the kernels stage then sums each token's local copies and reduce-scatters the
partial sums [N, D] to the token's owner after the grouped matmul has finished. Here the combine is per copy, in the
matmul kernel (production's fused EP MoE does the same: tpu-inference #3288, #3346):

    recv[owner(t)][t % n, j] = expert_{ids[t, j]}(x[t])   for every copy (t, j) whose expert is on this device

1. the sorted rows and grid are `moe_pallas`'s (`ffn_call`: visits of (row tile, group), F tiles, FP8 in VMEM);
2. at a row tile's last step its float32 accumulator is rounded into one of two VMEM stages (x's dtype), and one
   remote DMA per routed row of the tile starts: stage row -> `recv` row `dest % n_out` on device `dest // n_out`
   (`dest` [R]: -1 for rows of no local expert); the stage is reused two tiles later, after its sends complete, so
   a tile's transfers run while the next tile computes;
3. a barrier first (no device writes into a peer's `recv` before that peer's kernel has started), and at the last
   step every send is waited for, then every row this device will receive (`expect`: its own tokens' real copies,
   each one row DMA of the same size).
`recv` [n_out = n·k, D] is this device's tokens' copies, in copy order; the caller weighs and sums them
(`routing.moe_ep`). Slots of copies that route nowhere (padding tokens) stay unwritten.

Bytes on the wire: one row per routed copy, N·k/ep rows a device (1.25 N at k = 10 over 8 devices) against the
reduce-scatter's (ep-1)/ep·N; the fused kernel trades them for overlap (the cost model prices both).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35_lib.kernels.moe_pallas import ffn_accumulate, ffn_call, interpret_default, out_struct, run_pallas

COLLECTIVE_ID = 7  # the barrier semaphore's collective id (one per kernel that takes the device barrier)


def _coords(d, sizes: tuple[int, ...]) -> tuple:
    """Flat device index d over mesh axes of `sizes` (major first) -> its mesh coordinates."""
    out = []
    for s in reversed(sizes):
        out.append(d % s)
        d = d // s
    return tuple(reversed(out))


def _fused_kernel(tile_ref, expert_ref, kind_ref, first_ref, start_ref, end_ref, fixed_ref, layer_ref,  # prefetch
                  x_ref, wg_ref, wu_ref, wd_ref, *rest, tm: int, fp8_block: int | None, n_out: int,
                  sizes: tuple[int, ...], view: tuple[int, int]):
    """One (visit v, F tile f) step of the grouped FFN (`ffn_accumulate`), then the tile's sends (see the module)."""
    del expert_ref, fixed_ref, layer_ref  # used by the index maps only
    if fp8_block:
        sg_ref, su_ref, sd_ref, dest_ref, expect_ref, recv_ref, wg_s, wu_s, wd_s, *rest = rest
        scales, dequantized = (sg_ref, su_ref, sd_ref), (wg_s, wu_s, wd_s)
    else:
        dest_ref, expect_ref, recv_ref, *rest = rest
        scales, dequantized = (), ()
    acc_ref, stage_ref, sent_ref, send_sems, recv_sem = rest
    v, f = pl.program_id(0), pl.program_id(1)
    V, nf = pl.num_programs(0), pl.num_programs(1)
    devices = math.prod(sizes)

    def row_copy(s, r, d):  # stage row (s, r) -> recv row d % n_out of device d // n_out: one [view] row
        return pltpu.make_async_remote_copy(stage_ref.at[s, r], recv_ref.at[d % n_out], send_sems.at[s], recv_sem,
                                           device_id=_coords(d // n_out, sizes),
                                           device_id_type=pl.DeviceIdType.MESH)

    def wait_sends(s):  # every send started from stage s (same-size rows: one wait each)
        jax.lax.fori_loop(0, sent_ref[s], lambda i, c: (row_copy(s, 0, 0).wait_send(), c)[1], 0)

    @pl.when((v == 0) & (f == 0))
    def _barrier():  # every device inside the kernel (its recv allocated) before anyone writes into it
        barrier = pltpu.get_barrier_semaphore()
        for d in range(devices):
            pl.semaphore_signal(barrier, device_id=_coords(d, sizes), device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(barrier, devices)
        sent_ref[0] = 0
        sent_ref[1] = 0

    last = ffn_accumulate(tile_ref, kind_ref, first_ref, start_ref, end_ref, x_ref, wg_ref, wu_ref, wd_ref, scales,
                          dequantized, acc_ref, tm=tm, fp8_block=fp8_block)

    @pl.when((f == nf - 1) & last)
    def _send():  # the tile is whole: its routed rows leave while the next tiles compute
        tile = tile_ref[v]
        s = tile % 2
        wait_sends(s)  # the stage's sends of two tiles ago
        stage_ref[s] = acc_ref[...].astype(stage_ref.dtype).reshape(tm, *view)

        def send(r, count):
            d = dest_ref[tile * tm + r]

            @pl.when(d >= 0)
            def _():
                row_copy(s, r, d).start()

            return count + (d >= 0).astype(jnp.int32)

        sent_ref[s] = jax.lax.fori_loop(0, tm, send, jnp.int32(0))

    @pl.when((v == V - 1) & (f == nf - 1))
    def _drain():  # our sends done, then every row of our tokens arrived
        wait_sends(0)
        wait_sends(1)
        jax.lax.fori_loop(0, expect_ref[0], lambda i, c: (row_copy(0, 0, 0).wait_recv(), c)[1], 0)



def moe_fused_ep(x_sorted, group_sizes, w_gate_up, w_down, fp8_block, group_offset, dest, expect, n_out: int,
                 sizes: tuple[int, ...], *, interpret=None, tm: int | None = None, tf: int | None = None):
    """Grouped SwiGLU over this device's expert-sorted rows, each routed row sent home by remote DMA.

    x_sorted [R, D], group_sizes [G], weights as `moe_pallas` (one layer or `LayerOf` stacks, dense or BlockFP8),
    `group_offset` the first local expert; dest int32 [R]: device * n_out + slot for a routed row, -1 for rows of
    no local expert; expect int32 []: rows this device receives; `sizes`: the mesh axes' sizes ('chip', 'core')
    the shard_map runs over. Returns recv [n_out, D] (x's dtype): row slot filled by whichever device ran that copy,
    unwritten where no copy came. Runs inside `shard_map`; off a TPU in the TPU interpreter (remote DMAs and
    semaphores need it: `pltpu.InterpretParams`).
    """
    interpret = interpret_default() if interpret is None else interpret
    if interpret is True:
        interpret = pltpu.InterpretParams()
    R, D = x_sorted.shape
    c = ffn_call(x_sorted, group_sizes, w_gate_up, w_down, fp8_block, group_offset, tm, tf)
    dest = jnp.pad(dest.astype(jnp.int32), (0, c.grid_rows - R), constant_values=-1)  # [T*tm]
    expect = jnp.reshape(expect, (1,)).astype(jnp.int32)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    scratch = [*c.dequantized, c.acc, pltpu.VMEM((2, c.tm, *c.view), x_sorted.dtype), pltpu.SMEM((2,), jnp.int32),
               pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA]
    kernel = functools.partial(_fused_kernel, tm=c.tm, fp8_block=c.fp8_block, n_out=n_out, sizes=tuple(sizes),
                               view=c.view)
    make_call = lambda out_shape, interpret: pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(c.plan), grid=c.grid, in_specs=[*c.in_specs, smem, smem],
            out_specs=pl.BlockSpec(memory_space=pl.ANY), scratch_shapes=scratch),
        out_shape=out_shape,
        cost_estimate=c.cost,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=c.vmem_limit, collective_id=COLLECTIVE_ID,
                                             has_side_effects=True),
        interpret=interpret,
    )
    args = (*c.plan, *c.args, dest, expect)
    recv = run_pallas(make_call, out_struct((n_out, *c.view), x_sorted.dtype, *args), interpret, *args)
    return recv.reshape(n_out, D)


__all__ = ["COLLECTIVE_ID", "moe_fused_ep"]
