"""kernels.permute.pallas: the Pallas dispatch gather and combine scatter (interpret mode) against the XLA
twins."""

import jax
import numpy as np
import pytest

from qwen35_lib.kernels.permute.pallas import combine_pallas, dispatch_pallas, gather_reduce
from qwen35_lib.kernels.permute.xla import combine_xla, dispatch_xla


@pytest.mark.parametrize("T,D_,dtype", [(13, 256, "float32"), (9, 48, "bfloat16")])  # [R, 128] and [1, D] rows
def test_pallas_permute_matches_xla(T, D_, dtype):
    kx, ki, kw, ky = jax.random.split(jax.random.key(T), 4)
    x = jax.random.normal(kx, (T, D_)).astype(dtype)
    ids = jax.random.randint(ki, (T, 3), 0, 5)
    got, want = jax.jit(dispatch_pallas, static_argnums=2)(x, ids, 5), dispatch_xla(x, ids, 5)
    for g, w in zip(got, want):  # a permutation: exact
        np.testing.assert_array_equal(g, w)
    y = jax.random.normal(ky, (3 * T, D_)).astype(dtype)
    w = jax.random.uniform(kw, (T, 3)).astype(dtype)
    got = jax.jit(combine_pallas)(y, want[2], w)  # in y's dtype: the float32 sums rounded in the kernel
    assert got.dtype == y.dtype
    inv = np.argsort(np.asarray(want[2])).astype(np.int32)  # copy -> its sorted row
    sums = jax.jit(gather_reduce)(y, inv, w)  # [T, D] float32: the same kernel's sums, written unrounded
    np.testing.assert_array_equal(got, sums.astype(y.dtype))  # one rounding, as the callers' cast
    # float32 accumulation of the same k products in both: order only
    np.testing.assert_allclose(sums, combine_xla(y, want[2], w), atol=1e-5, rtol=1e-5)
