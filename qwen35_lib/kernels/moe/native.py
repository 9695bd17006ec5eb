"""The grouped SwiGLU expert FFNs as a native CPU kernel: the `moe_matmul` slot's `native` implementation.

Same protocol as `moe.xla` (`fn(x_sorted, group_sizes, w_gate_up, w_down, fp8_block) -> y_sorted`), computed by
the C++ handler of `native/moe.cc` (built on first use for this CPU's ISA, `kernels.native.build`): units of (expert, up
to 96 of its rows) over XLA's intra-op threads, each two register-blocked matmuls that read the expert's weights in
place.
What it removes on XLA:CPU: `moe_loop` copies each touched expert before few-row dots that run at about half
the memory bandwidth. qwen3.5-mini, float32, 8 layers chained (each layer's weights its own arrays), ms a layer:
at 8 tokens (64 copies) `moe_loop` 4.6 -> 1.4; the fused form (`moe_native_fused`, what the model runs) against
`moe_loop_fused` at 512 tokens 29.0 -> 10.2, at 2,048 95.5 -> 36.7 (bfloat16: 28.1 -> 10.4 at 512).
The expert stacks may come panel-packed (`PanelPacked`, stored so by `layer_loop.prepare_weights` on the CPU): the
same results bit for bit, each register block's weights one contiguous stream (the 8 layers of the engine's
decode step, its own weights and routing, interleaved: 11.1 -> 10.4 ms; at 512 tokens 77.9 -> 76.1 ms).

Where it cannot run, `moe_loop` (or `moe_loop_fused`) runs, with the same result up to summation order:
- the C++ library could not be built (a warning once; `build.unavailable("moe")` says why) or
  `QWEN35_NATIVE=0`;
- FP8 expert weights, or x and the weights in different dtypes, or a dtype other than float32 / bfloat16;
- a platform other than the CPU (a plan bound for a TPU runs the XLA loop; called directly, without the plan's
  platform, `build.on_cpu` leaves the choice to the lowering).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.moe.xla import moe_loop, moe_loop_fused
from qwen35_lib.kernels.native import build
from qwen35_lib.kernels.native.packed import PanelPacked, pack_panels, unpack_panels
from qwen35_lib.kernels.registry import register
from qwen35_lib.weights import BlockFP8

LIBRARY, HANDLER, FUSED = "moe", "qwen35_moe_grouped_swiglu", "qwen35_moe_grouped_swiglu_fused"
DTYPES = (jnp.float32, jnp.bfloat16)


def native_target(x, w_gate_up, w_down, handler: str = HANDLER) -> str | None:
    """The handler's custom-call target where it takes these operands (None: the XLA loop runs; packed weights
    unpacked)."""
    if any(isinstance(w, BlockFP8) for w in (w_gate_up, w_down)):
        return None
    if x.dtype not in DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        return None
    return build.ffi_target(LIBRARY, handler)


def moe_native(x, group_sizes, w_gate_up, w_down, fp8_block=None, *, platform: str | None = None):
    """y_sorted [N, D] from x_sorted [N, D], group_sizes [E], w_gate_up [E, D, 2, F], w_down [E, F, D]; `platform`:
    the plan's (`build.on_cpu`)."""
    target = native_target(x, w_gate_up, w_down)
    xla = lambda x, sizes, wgu, wd: moe_loop(x, sizes, *_logical((w_gate_up, w_down), (wgu, wd)), fp8_block)
    if target is None:
        return xla(x, group_sizes, *_buffers(w_gate_up, w_down))
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")
    return build.on_cpu(platform, (x, group_sizes.astype(jnp.int32), *_buffers(w_gate_up, w_down)), call, xla)


def _buffers(*ws):
    """What the handler takes: a packed stack's data [E, K * N], other arrays as they are."""
    return tuple(w.data if isinstance(w, PanelPacked) else w for w in ws)


def _logical(ws, bufs):
    """`bufs` (`_buffers(*ws)`, traced) as the logical stacks the XLA kernels take."""
    return tuple(unpack_panels(dataclasses.replace(w, data=b)) if isinstance(w, PanelPacked) else b
                 for w, b in zip(ws, bufs))


def pack_experts(w: jax.Array) -> PanelPacked:
    """An expert stack [E, K, ...] (`w_gate_up` [E, D, 2, F], `w_down` [E, F, D]) in the handler's packed layout:
    each expert's [K, N] matrix as its panels (`native.packed.PanelPacked`; a copy). Why: the register blocks read 64
    columns of every row; row-major, that is 256 bytes every N * 4, which the CPU's prefetchers follow worse than
    one stream (qwen3.5-mini, float32, 8 chained layers, random routing: 8 tokens 1.39 -> 1.29 ms a layer, 512
    tokens 9.4 -> 8.9)."""
    return pack_panels(w, lead=1, k_dims=1)


def moe_native_fused(x, ids, weights, num_groups: int, w_gate_up, w_down, fp8_block=None, *,
                     platform: str | None = None):
    """Dispatch, grouped matmul and combine in one call: the routed experts' output [T, D] from the tokens x [T, D],
    their expert ids [T, k] and routing weights [T, k] (ids >= the expert count: routed nowhere), as
    `moe.xla.moe_loop_fused` computes it. The handler sorts the copies itself (a counting sort of [T*k] ids),
    gathers each unit's rows as it converts them, and writes each copy's weighted output to a float32 [T*k, D]
    buffer (the call's second result, dropped) that a last pass sums per token in slot order. No sorted copies of
    the rows in XLA, no scatter. Where the handler does not take the operands, `moe_loop_fused` runs."""
    target = native_target(x, w_gate_up, w_down, FUSED)

    def xla(x, ids, weights, wgu, wd):
        return moe_loop_fused(x, ids, weights, num_groups, *_logical((w_gate_up, w_down), (wgu, wd)), fp8_block)

    if target is None:
        return xla(x, ids, weights, *_buffers(w_gate_up, w_down))
    T, k = ids.shape
    shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((T * k, x.shape[1]), jnp.float32))
    call = jax.ffi.ffi_call(target, shapes, vmap_method="sequential")
    return build.on_cpu(platform, (x, ids.astype(jnp.int32), weights.astype(x.dtype), *_buffers(w_gate_up, w_down)),
                         lambda *a: call(*a)[0], xla)


# `model.moe.routed_experts` runs the fused form wherever the library is built (every size: at 8 tokens it saves the
# XLA dispatch and combine too); without it, the XLA loop's fused form where the loop fuses (prefill sizes).
moe_native.fuses = lambda copies, num_experts: (build.load(LIBRARY) is not None
                                                or moe_loop.fuses(copies, num_experts))
moe_native.fused = moe_native_fused
# `layer_loop.prepare_weights` packs the per-layer expert stacks with this where the library loads
moe_native.pack = lambda w: (pack_experts(w) if build.load(LIBRARY) is not None and not isinstance(w, BlockFP8)
                             and w.dtype in DTYPES else w)


@register("moe_matmul", "native", per_platform=True)
def _moe_native_for(platform: str):
    """`moe_native`, and its fused form, for a plan bound for `platform` (`build.on_cpu`)."""
    fn = functools.partial(moe_native, platform=platform)
    fn.fuses, fn.pack, fn.fused = moe_native.fuses, moe_native.pack, functools.partial(moe_native_fused,
                                                                                        platform=platform)
    return fn
