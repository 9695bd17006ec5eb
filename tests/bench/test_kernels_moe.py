"""bench.kernels_moe: the variants `bench kernels` times are no slot implementation, and megablox `gmm` (interpret mode
off a TPU) computes the slot's FFN: every group, empty ones and padding rows, and the local groups of an offset."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.bench.kernels_moe import VARIANTS, moe_megablox
from qwen35_lib.kernels import available
from qwen35_lib.kernels.moe.xla import moe_ragged_dot

D, F, N = 256, 256, 120  # TPU-shaped (multiples of 128); N is not a multiple of a row tile
megablox = jax.jit(moe_megablox, static_argnames="fp8_block")


def _weights(experts: int):
    k1, k2 = jax.random.split(jax.random.key(1))
    return 0.05 * jax.random.normal(k1, (experts, D, 2, F)), 0.05 * jax.random.normal(k2, (experts, F, D))


def test_variants_are_not_slot_implementations():
    assert not set(VARIANTS) & set(available("moe_matmul"))


@pytest.mark.parametrize("sizes", [[0, 37, 0, 5, 60, 1], [20, 20, 20, 20, 20, 20]])  # empty groups, 17 padding rows
def test_megablox_matches_ragged_dot(sizes):
    x = jax.random.normal(jax.random.key(0), (N, D))
    sizes = jnp.array(sizes, jnp.int32)
    wgu, wd = _weights(6)
    np.testing.assert_allclose(megablox(x, sizes, wgu, wd), moe_ragged_dot(x, sizes, wgu, wd), atol=2e-5, rtol=2e-5)


def test_megablox_group_offset_keeps_the_local_groups_rows():
    # 9 global groups, 4 local experts (groups 3..6): the other rows and padding rows give 0
    sizes = jnp.array([11, 0, 7, 13, 0, 30, 2, 9, 14], jnp.int32)  # sum 86 of N = 120 rows
    x = jax.random.normal(jax.random.key(2), (N, D))
    wgu, wd = _weights(4)
    pad = lambda w: jnp.concatenate([jnp.zeros((3,) + w.shape[1:]), w, jnp.zeros((2,) + w.shape[1:])])  # [9, ...]
    ends = np.cumsum(np.asarray(sizes))
    rows = np.arange(N)[:, None]
    want = jnp.where((rows >= ends[2]) & (rows < ends[6]), moe_ragged_dot(x, sizes, pad(wgu), pad(wd)), 0.0)
    got = megablox(x, sizes, wgu, wd, group_offset=jnp.int32(3))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
