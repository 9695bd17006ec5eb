"""kernels.permute.xla: dispatch then combine with equal weights gives the tokens back."""

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.kernels import get


def test_permute_roundtrip():
    permute = get("permute", "xla")
    x = jax.random.normal(jax.random.key(0), (7, 5))
    ids = jax.random.randint(jax.random.key(1), (7, 3), 0, 4)
    xs, sizes, order = permute.dispatch(x, ids, 4)
    assert int(sizes.sum()) == 21 and bool(jnp.all(jnp.diff(ids.reshape(-1)[order]) >= 0))
    w = jnp.ones((7, 3)) / 3
    np.testing.assert_allclose(permute.combine(xs, order, w), x, atol=1e-6)
