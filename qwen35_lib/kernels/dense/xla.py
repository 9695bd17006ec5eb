"""Dense projections by XLA's dot: the `dense` slot's "xla" implementation. It does not read stacks, so the layer
scan slices each group's projections and `forms.linear` runs the dot on the slice; on a `LayerOf` view (a
test's, the twin of `dense.pallas.stacked_linear`) it takes the layer first."""

from __future__ import annotations

import jax

from qwen35_lib.kernels.dense.forms import dot
from qwen35_lib.kernels.registry import register
from qwen35_lib.kernels.stacked import LayerOf


@register("dense", "xla")
def dense_xla(x: jax.Array, w: LayerOf, contract: int = 1, dtype=None) -> jax.Array:
    """x [..., in...] @ the layer `w` selects [in..., out...] over x's last `contract` dims, float32 accumulation,
    returned in `dtype` (default: x's)."""
    return dot(x, w.take(), contract, dtype)
