"""kernels.stacked: `LayerOf` names one layer of a [G, P, ...] stack; `take` reads that layer, for plain arrays and
`BlockFP8` pairs alike."""

import jax.numpy as jnp
import numpy as np

from qwen35_lib.kernels.stacked import LayerOf, layer_index
from qwen35_lib.weights import BlockFP8


def test_take_reads_the_named_layer():
    stack = jnp.arange(2 * 3 * 4).reshape(2, 3, 4)
    idx = layer_index(1, 2)
    assert idx.dtype == jnp.int32 and idx.tolist() == [1, 2]
    np.testing.assert_array_equal(LayerOf(stack, idx).take(), [20, 21, 22, 23])  # (1 * 3 + 2) * 4 + [0..3]
    pair = BlockFP8(stack, -stack)
    got = LayerOf(pair, layer_index(0, 1)).take()
    np.testing.assert_array_equal(got.value, [4, 5, 6, 7])
    np.testing.assert_array_equal(got.scale, [-4, -5, -6, -7])
