"""Token permutation for the MoE in plain XLA: the reference twin of the `permute` slot.

`dispatch` sorts the T*k (token, expert) copies by expert so each expert's rows are contiguous (what a grouped
matmul wants); `combine` puts expert outputs back in token order and sums each token's k outputs, weighted.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.registry import register


class Permute(NamedTuple):
    dispatch: Callable  # (x [T, D], expert_ids [T, k], num_experts) -> (x_sorted [T*k, D], group_sizes [E], order)
    combine: Callable  # (y_sorted [T*k, D], order [T*k], weights [T, k]) -> [T, D]


def dispatch_xla(x: jax.Array, expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    T, k = expert_ids.shape
    flat = expert_ids.reshape(T * k)  # [T*k]: copy i is token i // k
    order = jnp.argsort(flat, stable=True)  # [T*k]: sorted position -> copy
    x_sorted = x[order // k]  # [T*k, D]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    return x_sorted, group_sizes, order


def combine_xla(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    T, k = weights.shape
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(T, k, -1)  # [T, k, D] in copy order
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype), preferred_element_type=jnp.float32)


register("permute", "xla")(Permute(dispatch_xla, combine_xla))
