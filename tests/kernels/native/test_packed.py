"""native.packed: a weight as its 64-column panels, and back, for expert stacks (one leading dim) and projections
(one or two contracted dims), with a last panel narrower where the columns are not a multiple of 64."""

import jax
import numpy as np
import pytest

from qwen35_lib.kernels.moe import native as moe_native
from qwen35_lib.kernels.native import packed


@pytest.mark.parametrize("shape", [(3, 16, 2, 8), (3, 48, 2, 24), (2, 40, 70), (2, 64, 128)])  # N: whole panels or not
def test_expert_stacks_round_trip(shape):
    w = jax.random.normal(jax.random.key(len(shape)), shape)
    stack = moe_native.pack_experts(w)
    assert stack.shape == shape and stack.dtype == w.dtype and stack.data.shape == (shape[0], w.size // shape[0])
    np.testing.assert_array_equal(packed.unpack_panels(stack), w)
    E, K = shape[:2]
    first_panel = np.asarray(w).reshape(E, K, -1)[:, :, :packed.PANEL]
    np.testing.assert_array_equal(stack.data[:, :first_panel[0].size], first_panel.reshape(E, -1))


@pytest.mark.parametrize("shape,k_dims", [((48, 130), 1), ((4, 12, 192), 2), ((64, 3, 64), 1)])
def test_projections_round_trip_panel_by_panel(shape, k_dims):
    w = jax.random.normal(jax.random.key(k_dims), shape)
    p = packed.pack_panels(w, lead=0, k_dims=k_dims)
    K, N = p.kn
    assert (K, N) == (int(np.prod(shape[:k_dims])), int(np.prod(shape[k_dims:]))) and p.data.shape == (K * N,)
    m = np.asarray(w).reshape(K, N)
    for n, width in packed.panels(N):  # panel n: its columns, row-major, at K * n
        np.testing.assert_array_equal(np.asarray(p.data[K * n:K * (n + width)]).reshape(K, width), m[:, n:n + width])
    np.testing.assert_array_equal(packed.unpack_panels(p), w)
    assert packed.unpack_panels(w) is w


def test_a_packed_weight_is_a_pytree_with_static_layout():
    p = packed.pack_panels(jax.random.normal(jax.random.key(0), (8, 64)))
    leaves, tree = jax.tree.flatten(p)
    assert len(leaves) == 1 and jax.tree.unflatten(tree, leaves).shape == (8, 64)
    assert jax.jit(lambda p: p.data * 2)(p).shape == (8 * 64,)
