"""kernels.dense.xla: the `dense` slot's reference twin reads the layer a `LayerOf` names, as `linear` would."""

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.kernels import get
from qwen35_lib.kernels.stacked import LayerOf, layer_index


def test_the_twin_contracts_the_named_layer():
    dense = get("dense", "xla")
    x = jax.random.normal(jax.random.key(0), (3, 4, 6))  # [.., A, K]: an output projection's input
    stack = jax.random.normal(jax.random.key(1), (2, 3, 4, 6, 5))  # [G, P, A, K, N]
    y = dense(x, LayerOf(stack, layer_index(1, 0)), 2)
    np.testing.assert_allclose(y, jnp.einsum("tak,akn->tn", x, stack[1, 0]), rtol=1e-5, atol=1e-5)
    bf16 = LayerOf(stack.astype(jnp.bfloat16), layer_index(0, 2))
    assert dense(x.astype(jnp.bfloat16), bf16, 2).dtype == jnp.bfloat16
