"""The grouped SwiGLU expert FFNs as a native CPU kernel: the `moe_matmul` slot's `native` implementation.

Same protocol as `moe_xla` (`fn(x_sorted, group_sizes, w_gate_up, w_down, fp8_block) -> y_sorted`), computed by
the C++ handler of `moe_native.cc` (built on first use, `kernels.native`): units of (expert, up to 96 of its
rows) over XLA's intra-op threads, each two register-blocked matmuls that read the expert's weights in place.
What it removes on XLA:CPU (qwen3.5-mini, float32, 8 layers chained, each layer's weights its own arrays):
`moe_loop` copies each touched expert before few-row dots that run at about half the memory bandwidth; at
8 tokens (64 copies) 4.6 -> 1.4 ms a layer, at 512 tokens 31 -> 10.6 ms.

Runs where it can and says so; elsewhere `moe_loop` runs, with the same result up to summation order:
- the C++ library could not be built (no compiler: `native.unavailable("moe_native")` says why) or
  `QWEN35_NATIVE=0`;
- FP8 expert weights, or x and the weights in different dtypes, or a dtype other than float32 / bfloat16;
- a platform other than the CPU (`lax.platform_dependent`: a plan bound for a TPU lowers the XLA loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.kernels import native
from qwen35_lib.kernels.moe_xla import moe_loop, moe_loop_fused
from qwen35_lib.kernels.registry import register
from qwen35_lib.weights import BlockFP8

LIBRARY, HANDLER = "moe_native", "qwen35_moe_grouped_swiglu"
DTYPES = (jnp.float32, jnp.bfloat16)


def native_target(x, w_gate_up, w_down) -> str | None:
    """The handler's custom-call target where it takes these operands (None: `moe_loop` runs)."""
    if any(isinstance(w, BlockFP8) for w in (w_gate_up, w_down)):
        return None
    if x.dtype not in DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        return None
    return native.ffi_target(LIBRARY, HANDLER)


@register("moe_matmul", "native")
def moe_native(x, group_sizes, w_gate_up, w_down, fp8_block=None):
    """y_sorted [N, D] from x_sorted [N, D], group_sizes [E], w_gate_up [E, D, 2, F], w_down [E, F, D]."""
    target = native_target(x, w_gate_up, w_down)
    xla = lambda x, sizes, wgu, wd: moe_loop(x, sizes, wgu, wd, fp8_block)
    if target is None:
        return xla(x, group_sizes, w_gate_up, w_down)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")
    return jax.lax.platform_dependent(x, group_sizes.astype(jnp.int32), w_gate_up, w_down, cpu=call, default=xla)


# Without the library, the XLA loop's fused form keeps its place at prefill sizes (`model.moe.routed_experts`).
moe_native.fuses = lambda copies, num_experts: (native.load(LIBRARY) is None and moe_loop.fuses(copies, num_experts))
moe_native.fused = moe_loop_fused
