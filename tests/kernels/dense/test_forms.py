"""kernels.dense.forms: `linear` runs each form of a weight through its own kernel (an array: XLA's dot; a stack's
layer: the view's `read`; panel-packed: the native handler) to the same product; `pack` packs only what the handler
takes."""

import jax.numpy as jnp
import numpy as np

from qwen35_lib.kernels import get
from qwen35_lib.kernels.dense import linear, pack
from qwen35_lib.kernels.native import build
from qwen35_lib.kernels.native.packed import PanelPacked
from qwen35_lib.kernels.stacked import LayerOf, layer_index


def test_linear_runs_each_form_to_the_same_product():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((8, 128)).astype(np.float32)
    want = x @ w
    np.testing.assert_allclose(linear(jnp.asarray(x), jnp.asarray(w)), want, rtol=1e-5, atol=1e-5)
    seen = []
    read = lambda x, v, contract, dtype: seen.append(contract) or get("dense", "xla")(x, v, contract, dtype)
    layer = LayerOf(jnp.stack([jnp.stack([jnp.zeros_like(w), jnp.asarray(w)])]), layer_index(0, 1), read)  # [1, 2]
    np.testing.assert_allclose(linear(jnp.asarray(x), layer), want, rtol=1e-5, atol=1e-5)
    assert seen == [1]  # the view's own kernel ran
    packed = pack(jnp.asarray(w))
    assert isinstance(packed, PanelPacked) == (build.load("dense") is not None)
    np.testing.assert_allclose(linear(jnp.asarray(x), packed), want, rtol=1e-5, atol=1e-5)


def test_pack_leaves_what_the_handler_cannot_take():
    for w in (jnp.ones((8, 65)), jnp.ones((8, 64), jnp.int32), jnp.ones((64,))):  # a partial panel, ints, no K
        assert pack(w) is w
