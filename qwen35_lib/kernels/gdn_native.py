"""The GDN decode step as a native CPU kernel: the `gdn` slot's `native` implementation.

`ragged` is `gdn_xla.gdn_ragged_xla` with its decode region (one token per sequence, each from its state slot)
computed by the C++ handler of `gdn_native.cc` (built on first use, `kernels.native`), which updates the slots in
place; the prefill region stays XLA's chunked form, and `dense` is XLA's. What it removes on XLA:CPU: the
recurrent step's batched matrix-vector products (`einsum("bhkv,bhk->bhv")`: about 0.12 ms each on qwen3.5-mini's
[8, 8, 64, 64] state at 8 sequences, where one pass over the state takes 0.01 ms) and the gather and scatter of
the slots around them.

Where it cannot run, `gdn_decode_xla` runs, with the same result up to rounding:
- the C++ library could not be built (`native.unavailable("gdn_native")` says why) or `QWEN35_NATIVE=0`;
- a state pool other than float32, or q, k, v not float32 / bfloat16;
- a platform other than the CPU (`lax.platform_dependent`: a plan bound for a TPU lowers the XLA form);
- a step that XLA partitions over several devices (a multi-device layout: the handler would not be split).
Unlike the XLA form it leaves the null slot 0 alone (padding rows write nothing), which no sequence reads.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from qwen35_lib.kernels import native
from qwen35_lib.kernels.gdn_xla import gdn_decode_xla, gdn_ragged_xla, gdn_xla
from qwen35_lib.kernels.registry import GdnKernels, register

LIBRARY, HANDLER = "gdn_native", "qwen35_gdn_decode"


def native_target(q, v, states) -> str | None:
    """The handler's custom-call target where it takes these operands (None: the XLA form runs)."""
    if states.dtype != jnp.float32 or q.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != q.dtype:
        return None
    return native.ffi_target(LIBRARY, HANDLER)


def _partitioned() -> bool:
    """True when traced under a mesh that XLA partitions (a multi-device layout's step: `parallel.ranks.per_rank`
    leaves the XLA GDN to the SPMD partitioner). A custom call there would have its operands gathered whole onto
    every device; inside a `shard_map` (every axis manual) or on one device it runs per device."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1 and not mesh.are_all_axes_manual


def gdn_decode_native(q, k, v, g, beta, slot, start, states):
    """`gdn_decode_xla`'s protocol (q, k [D, Hk, dk], v [D, Hv, dv], g, beta [D, Hv], slot [D] with -1 for padding,
    start [D] bool, states [NS, Hv, dk, dv]) -> (o [D, Hv, dv] float32, states), by the C++ handler."""
    target = native_target(q, v, states)
    if target is None or _partitioned():
        return gdn_decode_xla(q, k, v, g, beta, slot, start, states)
    D, Hv, dv = v.shape
    shapes = (jax.ShapeDtypeStruct((D, Hv, dv), jnp.float32), jax.ShapeDtypeStruct(states.shape, states.dtype))
    # vmapped (the model's ranks): one call over a leading rank axis, its pools updated in place ("sequential" would
    # loop over the ranks, copying each rank's pool out and back)
    call = jax.ffi.ffi_call(target, shapes, vmap_method="broadcast_all", input_output_aliases={7: 1})
    args = (q, k.astype(q.dtype), v, g.astype(jnp.float32), beta.astype(jnp.float32), slot.astype(jnp.int32),
            start.astype(jnp.int32), states)
    xla = lambda q, k, v, g, beta, slot, start, states: gdn_decode_xla(q, k, v, g, beta, slot, start > 0, states)
    return jax.lax.platform_dependent(*args, cpu=lambda *a: tuple(call(*a)), default=xla)


register("gdn", "native")(GdnKernels(dense=gdn_xla, ragged=partial(gdn_ragged_xla, decode=gdn_decode_native)))
