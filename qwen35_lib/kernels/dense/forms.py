"""A projection over a weight in whichever form the layers hold it, and the CPU's re-layout of one: the one door
the model goes through to the `dense` slot (`model.layers.linear`, `model.layer_loop.prepare_weights`), so the
native wing's weight layout never leaves `kernels/`.

The forms `linear` takes, w of logical shape [*K, *N] (`contract` K dims):
- an array: XLA's dot, `dot`;
- a layer of a stack (`kernels.stacked.LayerOf`, the layer scan's where the plan's `dense` kernel reads stacks in
  place): that kernel, as the view's `read` runs it on every device's own rows (`model.layer_loop.with_dense`);
- panel-packed (`native.packed.PanelPacked`: what `pack` gives where the native library loads): the few-row
  handler, `native.linear_packed`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.dense.native import linear_packed, pack_dense
from qwen35_lib.kernels.native.packed import PanelPacked
from qwen35_lib.kernels.stacked import LayerOf


def dot(x: jax.Array, w: jax.Array, contract: int = 1, dtype=None) -> jax.Array:
    """x [..., *K] @ w [*K, *N] over x's last `contract` dims -> [..., *N], accumulated in float32, returned in
    `dtype` (default: x's)."""
    xd = tuple(range(x.ndim - contract, x.ndim))
    y = jax.lax.dot_general(x, w, ((xd, tuple(range(contract))), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(dtype or x.dtype)


def linear(x: jax.Array, w, contract: int = 1, dtype=None) -> jax.Array:
    """`dot(x, w, contract, dtype)` for w in any of the module's forms."""
    if isinstance(w, LayerOf):
        return w.read(x, w, contract, dtype)
    if isinstance(w, PanelPacked):
        return linear_packed(x, w, contract, dtype)
    return dot(x, w, contract, dtype)


def pack(w: jax.Array, contract: int = 1):
    """w [*K, *N] in the form `linear` runs fastest on this machine: panel-packed where the native handler loads
    and takes it (`native.pack_dense`), else `w` as given."""
    return pack_dense(w, contract)
