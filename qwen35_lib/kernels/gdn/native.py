"""The GDN recurrence as native CPU kernels: the `gdn` slot's `native` implementation.

Three C++ handlers (`native/gdn.cc`, built on first use, `kernels.native.build`) run the recurrent step of
`gdn.xla.gdn_recurrent` and update the state slots in place:
- `qwen35_gdn_decode`, the decode region of the ragged step (one token per sequence, each from its slot). What it
  removes on XLA:CPU: the recurrent step's batched matrix-vector products (`einsum("bhkv,bhk->bhv")`: about
  0.12 ms each on qwen3.5-mini's [8, 8, 64, 64] state at 8 sequences, where one pass over the state takes 0.01 ms)
  and the gather and scatter of the slots around them.
- `qwen35_gdn_prefill`, whole sequences token after token (the ragged step's prefill region, and the dense form
  of `forward`): each (sequence, head) state stays in L1 while its tokens run. It replaces XLA's chunked form
  (`gdn_chunked`: per-chunk WY terms, a triangular inverse, a scan of small dots), made of many small ops: on
  qwen3.5-mini's heads, one layer jitted alone, 5.6 ms against 1.2 at 8 sequences of 60 tokens, 38 against 4.9
  at one of 2,048 (2 cores).
- `qwen35_gdn_verify`, speculative verification's decode region (V = k + 1 tokens a row): each row's tokens in
  order on its slot's state (in L1), the state after each copied to its slot's checkpoints, both pools in place.
  What it removes on XLA:CPU (`gdn.xla.gdn_verify_xla`): the scan's V recurrent steps of small batched dots, the
  [D, V, Hv, dk, dv] states it stacks, and the scatters of the slots and checkpoints around them.
The chunked form computes the same recurrence in another order (outputs agree to ~1e-7 on O(1) values); the decode
and verify handlers run the same token step, so a verification's checkpoint n is bitwise the state of decoding its
row's first n + 1 tokens one step at a time.

Where it cannot run, `gdn_decode_xla` (`gdn_verify_xla`) runs, with the same result up to rounding:
- the C++ library could not be built (`build.unavailable("gdn")` says why) or `QWEN35_NATIVE=0`;
- a state pool other than float32, or q, k, v not float32 / bfloat16;
- a platform other than the CPU (a plan bound for a TPU runs the XLA form; called directly, without the plan's
  platform, `build.on_cpu` leaves the choice to the lowering);
- a step that XLA partitions over several devices (a multi-device layout: the handler would not be split).
Unlike the XLA form it leaves the null slot 0 alone (padding rows write nothing), which no sequence reads.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.gdn.xla import gdn_decode_xla, gdn_ragged_xla, gdn_verify_xla, gdn_xla
from qwen35_lib.kernels.native import build
from qwen35_lib.kernels.registry import GdnKernels, register

LIBRARY, HANDLER, PREFILL, VERIFY = "gdn", "qwen35_gdn_decode", "qwen35_gdn_prefill", "qwen35_gdn_verify"


def native_target(q, v, states, handler: str = HANDLER) -> str | None:
    """The handler's custom-call target where it takes these operands (None: the XLA form runs)."""
    if states.dtype != jnp.float32 or q.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != q.dtype:
        return None
    return build.ffi_target(LIBRARY, handler)


def _partitioned() -> bool:
    """True when traced under a mesh that XLA partitions (a multi-device layout's step: `parallel.ranks.per_rank`
    leaves the XLA GDN to the SPMD partitioner). A custom call there would have its operands gathered whole onto
    every device; inside a `shard_map` (every axis manual) or on one device it runs per device."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1 and not mesh.are_all_axes_manual


def gdn_decode_native(q, k, v, g, beta, slot, start, states, *, platform: str | None = None):
    """`gdn_decode_xla`'s protocol (q, k [D, Hk, dk], v [D, Hv, dv], g, beta [D, Hv], slot [D] with -1 for padding,
    start [D] bool, states [NS, Hv, dk, dv]) -> (o [D, Hv, dv] float32, states), by the C++ handler; `platform`:
    the plan's (`build.on_cpu`)."""
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
    return build.on_cpu(platform, args, lambda *a: tuple(call(*a)), xla)


def gdn_verify_native(q, k, v, g, beta, slot, start, states, checkpoints, *, platform: str | None = None):
    """`gdn_verify_xla`'s protocol (q, k [D V, Hk, dk], v [D V, Hv, dv], g, beta [D V, Hv], row i's tokens at
    [i V, i V + V); slot, start [D]; states [NS, Hv, dk, dv]; checkpoints [NS, V, Hv, dk, dv]) -> (o [D V, Hv, dv]
    float32, states, checkpoints), by the C++ handler, both pools in place; `platform`: the plan's."""
    target = native_target(q, v, states, VERIFY)
    if target is None or checkpoints.dtype != jnp.float32 or _partitioned():
        return gdn_verify_xla(q, k, v, g, beta, slot, start, states, checkpoints)
    N, Hv, dv = v.shape
    shapes = (jax.ShapeDtypeStruct((N, Hv, dv), jnp.float32), jax.ShapeDtypeStruct(states.shape, states.dtype),
              jax.ShapeDtypeStruct(checkpoints.shape, checkpoints.dtype))
    call = jax.ffi.ffi_call(target, shapes, vmap_method="broadcast_all", input_output_aliases={7: 1, 8: 2})
    args = (q, k.astype(q.dtype), v, g.astype(jnp.float32), beta.astype(jnp.float32), slot.astype(jnp.int32),
            start.astype(jnp.int32), states, checkpoints)
    xla = lambda q, k, v, g, beta, slot, start, *pools: gdn_verify_xla(q, k, v, g, beta, slot, start > 0, *pools)
    return build.on_cpu(platform, args, lambda *a: tuple(call(*a)), xla)


def gdn_prefill_native(q, k, v, g, beta, first, length, slot, start, states, fallback, *,
                       platform: str | None = None):
    """`gdn_ragged_xla`'s prefill protocol (q, k [N, Hk, dk], v [N, Hv, dv], g, beta [N, Hv]; per sequence s: its
    tokens [first, first + length), its slot and start, bool: False starts from a zero state; states [NS, Hv, dk,
    dv]) -> (o [N, Hv, dv] float32, 0 at tokens of no sequence; states, each sequence's final state in its slot),
    by the C++ handler, token after token; `fallback` (same arguments) where the handler cannot run; `platform`:
    the plan's (`build.on_cpu`)."""
    target = native_target(q, v, states, PREFILL)
    args = (q, k.astype(q.dtype), v, g.astype(jnp.float32), beta.astype(jnp.float32),
            *(x.astype(jnp.int32) for x in (first, length, slot, start)), states)
    if target is None or _partitioned():
        return fallback(*args)
    N, Hv, dv = v.shape
    shapes = (jax.ShapeDtypeStruct((N, Hv, dv), jnp.float32), jax.ShapeDtypeStruct(states.shape, states.dtype))
    call = jax.ffi.ffi_call(target, shapes, vmap_method="broadcast_all", input_output_aliases={9: 1})
    return build.on_cpu(platform, args, lambda *a: tuple(call(*a)), fallback)


def gdn_dense_native(q, k, v, g, beta, state, chunk_size: int = 64, *, platform: str | None = None):
    """`gdn_xla`'s protocol (q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv], state [B, Hv, dk, dv]):
    each row a sequence of T tokens from its state, by the prefill handler. Output o in v's dtype."""
    B, T, Hv, dv = v.shape
    flat = lambda x: x.reshape(B * T, *x.shape[2:])
    rows = jnp.arange(B, dtype=jnp.int32)

    def xla(q, k, v, g, beta, first, length, slot, start, state):
        o, S = gdn_xla(*(x.reshape(B, T, *x.shape[1:]) for x in (q, k, v, g, beta)), state, chunk_size)
        return flat(o).astype(jnp.float32), S

    o, S = gdn_prefill_native(*map(flat, (q, k, v, g, beta)), rows * T, jnp.full((B,), T), rows,
                              jnp.ones((B,), bool), state.astype(jnp.float32), fallback=xla, platform=platform)
    return o.reshape(B, T, Hv, dv).astype(v.dtype), S


register("gdn", "native", per_platform=True)(lambda platform: GdnKernels(
    dense=partial(gdn_dense_native, platform=platform),
    ragged=partial(gdn_ragged_xla, decode=partial(gdn_decode_native, platform=platform),
                   prefill=partial(gdn_prefill_native, platform=platform),
                   verify=partial(gdn_verify_native, platform=platform))))
