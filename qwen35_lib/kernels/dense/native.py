"""The decode step's dense projections on the CPU: a few rows times a panel-packed weight, by a native handler.

`model.layers.linear` calls `linear_packed` for a weight that `model.layer_loop.prepare_weights` packed
(`native.packed.PanelPacked`, on the CPU where this library loads: `pack_dense`). Up to MAX_ROWS rows (decode batches),
the C++ handler of `native/dense.cc` streams each 64-column panel once per register block; XLA:CPU's dot read the
row-major weight at 13-23 GB/s at 8 rows, the handler its packed panels at 20-30 (qwen3.5-mini's projections,
16 weights chained, K = 512, N = 256-4,096; at K = 128 it is slower, 11.8 against 14.4). More rows (prefill
chunks) run XLA's dot on the row-major weight, which `pack_dense` keeps beside the panels (unpacking it inside the
step instead made the engine's prefill step of 512 tokens about 9 ms longer; the decode step of 8 is 1.2 ms
shorter). Both accumulate in float32.

Where the handler cannot run (the library not built, `QWEN35_NATIVE=0`, a dtype other than float32 / bfloat16, a
platform other than the CPU), the XLA form runs on the same panels.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.native import build
from qwen35_lib.kernels.native.packed import PANEL, PanelPacked, pack_panels, unpack_panels

LIBRARY, HANDLER = "dense", "qwen35_dense_rows"
MAX_ROWS = 16  # rows the handler takes; more run XLA's dot (its GEMM nears the matmul peak at prefill sizes)


def pack_dense(w: jax.Array, contract: int = 1):
    """w [*K, *N] (`contract` K dims) packed for `linear_packed` where the handler loads and the weight is float32
    or bfloat16 with whole panels (N a multiple of PANEL), `w` itself kept beside the panels for XLA's dot at more
    rows (twice the bytes of the projections); else `w` as given."""
    N = math.prod(w.shape[contract:])
    if build.load(LIBRARY) is None or w.dtype not in (jnp.float32, jnp.bfloat16) or w.ndim <= contract or N % PANEL:
        return w
    return dataclasses.replace(pack_panels(w, lead=0, k_dims=contract), row_major=w)


def linear_packed(x: jax.Array, w: PanelPacked, contract: int = 1, dtype=None) -> jax.Array:
    """x [..., *K] @ w over the last `contract` dims of x -> [..., *N] in `dtype` (default: x's), accumulated in
    float32."""
    if w.lead or w.k_dims != contract:
        raise ValueError(f"a packed weight of {w.k_dims} contracted dims (lead {w.lead}) used with contract={contract}")
    K, N = w.kn
    lead, out = x.shape[:x.ndim - contract], w.shape[contract:]
    rows = math.prod(lead)
    x2 = x.reshape(rows, K)

    def xla(x2, data):  # XLA's dot on the row-major weight (kept, or unpacked: a copy of it)
        full = w.row_major if w.row_major is not None else unpack_panels(PanelPacked(data, w.shape, lead=0,
                                                                                    k_dims=contract))
        return jnp.dot(x2, full.reshape(K, N), preferred_element_type=jnp.float32)

    target = build.ffi_target(LIBRARY, HANDLER) if x.dtype == w.dtype and x.dtype in (jnp.float32, jnp.bfloat16) \
        else None
    if target is None or rows > MAX_ROWS:
        y = xla(x2, w.data)
    else:
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, N), jnp.float32), vmap_method="sequential")
        y = jax.lax.platform_dependent(x2, w.data, cpu=call, default=xla)
    return y.reshape(*lead, *out).astype(dtype or x.dtype)
