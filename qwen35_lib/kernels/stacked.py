"""One layer of a stacked weight, not sliced: what a kernel that reads scanned weights in place receives.

Inside the layer scan, `w[g, p]` of a stacked weight [G, P, ...] is a dynamic slice; a Pallas kernel (a custom
call) needs its operands as buffers, so XLA copies the slice every layer (the TPU7x compile shows one copy per
expert weight per layer). `LayerOf(stack, index)` hands the kernel the whole stack and the layer's (group,
position); the kernel scalar-prefetches the index and its BlockSpec index maps pick the layer's blocks.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


class LayerOf(NamedTuple):
    """Layer `index` = (group, position) of `stack`: a [G, P, ...] array or a `BlockFP8` pair of them."""

    stack: Any
    index: Any  # int32 [2]
    # a dense projection's: (x, self, contract, dtype) -> y, the plan's `dense` kernel as the layout runs it
    # (`model.layer_loop.with_dense`); None for the routed experts (the MoE kernel takes the view itself)
    read: Callable | None = None

    def in_specs(self, spec: P) -> LayerOf:
        """shard_map specs: `spec` (for the layer's [...] dims) under the two stacked dims; the index replicated."""
        return LayerOf(jax.tree.map(lambda _: P(None, None, *spec), self.stack), P())

    def take(self) -> Any:
        """The layer itself (a dynamic slice: a copy where a custom call reads it)."""
        g, p = self.index[0], self.index[1]
        return jax.tree.map(lambda a: a[g, p], self.stack)


def layer_index(group, position: int) -> jax.Array:
    """int32 [2]: (group, position) for `LayerOf`."""
    return jnp.stack([jnp.asarray(group, jnp.int32), jnp.asarray(position, jnp.int32)])
