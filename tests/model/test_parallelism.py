"""The one-device Parallelism: its MoE is the dropless local MoE (checked against the dense twin), its per-rank call
a vmap, and no parallelism given means it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.model.moe import moe_dense_reference, shared_expert
from qwen35_lib.model.parallelism import LOCAL, Local, check_parallelism
from qwen35_lib.plan import SINGLE


def test_no_parallelism_means_local_and_a_given_one_passes_through(tiny):
    cfg, _ = tiny
    assert check_parallelism(cfg, None) is LOCAL
    other = Local(SINGLE.replace(moe_kernel="ragged_dot"))
    assert check_parallelism(cfg, other) is other
    assert hash(Local()) == hash(LOCAL) and Local() == LOCAL  # a static jit argument: equal plans, one program
    assert LOCAL.plan is SINGLE and LOCAL.takes_valid


def test_local_moe_is_the_dense_twin_and_padding_gets_only_the_shared_expert(tiny):
    cfg, w = tiny
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((10, cfg.hidden_size)), jnp.float32)
    valid = jnp.arange(10) < 6

    @jax.jit
    def run(moe, x, valid):
        return (LOCAL.moe(cfg, moe, x), LOCAL.moe(cfg, moe, x, valid=valid), moe_dense_reference(cfg, moe, x),
                shared_expert(moe, x))

    out, padded, dense, shared = map(np.asarray, run(moe, x, valid))
    np.testing.assert_allclose(out, dense, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(padded[:6], dense[:6], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(padded[6:], shared[6:], rtol=2e-5, atol=1e-6)
    assert np.abs(dense[6:] - shared[6:]).max() > 1e-3  # the routed experts do add to a real token


def test_per_rank_is_a_vmap(tiny):
    cfg, _ = tiny
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(LOCAL.per_rank(cfg, "gdn", jnp.sum, x), [6.0, 22.0, 38.0])
