"""The MoE block's routing: padding tokens are routed to no expert, and so do not push the capacity kernel into its
fallback (a spy kernel records the group sizes it is given)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.kernels import registry
from qwen35_lib.kernels.registry import get
from qwen35_lib.model.moe import local_moe, shared_expert
from qwen35_lib.plan import SINGLE

SEEN = []  # group sizes the spy kernel was given (eager calls only)


def _spy(x, group_sizes, w_gate_up, w_down, fp8_block=None):
    SEEN.append(np.asarray(group_sizes))
    return get("moe_matmul", "ragged_dot")(x, group_sizes, w_gate_up, w_down, fp8_block)


@pytest.fixture
def spy_kernel():
    """`_spy` registered as moe_matmul "test_spy" for one test only (other modules list the registry's kernels:
    `bench kernels` would run it under jit)."""
    SEEN.clear()
    with registry.registered("moe_matmul", "test_spy", _spy):
        yield


@pytest.mark.usefixtures("spy_kernel")
def test_padding_tokens_route_to_no_expert(tiny):
    cfg, w = tiny
    spy = SINGLE.replace(moe_kernel="test_spy")
    moe = jax.tree.map(lambda a: a[0, 1], w["layers"]["moe"])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((24, cfg.hidden_size)), jnp.float32)
    valid = jnp.arange(24) % 3 != 0  # 16 real tokens, 8 padding
    SEEN.clear()
    got = local_moe(cfg, moe, x, valid, spy)
    (sizes,) = SEEN
    assert sizes.shape == (cfg.num_experts,) and sizes.sum() == 16 * cfg.num_experts_per_tok  # no padding copy
    ref = local_moe(cfg, moe, x[np.asarray(valid)], plan=spy)  # the real tokens alone
    np.testing.assert_allclose(got[np.asarray(valid)], ref, rtol=1e-5, atol=1e-6)
    pad = ~np.asarray(valid)  # routed part 0: the shared expert alone
    np.testing.assert_allclose(got[pad], shared_expert(moe, x)[pad], rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("spy_kernel")
def test_padding_does_not_push_capacity_into_its_fallback(tiny):
    """512 identical padding tokens (id 0's hidden state) with 64 real ones: the capacity kernel's groups hold only
    the real tokens' copies, so none exceeds its capacity (the fallback is not taken)."""
    cfg, w = tiny
    spy = SINGLE.replace(moe_kernel="test_spy")
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    real = np.random.default_rng(2).standard_normal((64, cfg.hidden_size)).astype(np.float32)
    x = jnp.asarray(np.concatenate([real, np.repeat(np.asarray(w["embed"][:1]), 512, 0)]))
    SEEN.clear()
    local_moe(cfg, moe, x, jnp.arange(576) < 64, spy)
    local_moe(cfg, moe, x, plan=spy)  # unmasked, as before: every padding copy lands on the same k experts
    masked, unmasked = SEEN
    N, E = 576 * cfg.num_experts_per_tok, cfg.num_experts
    C = -(-int(np.ceil(N / E + 4 * np.sqrt(N / E) + 2)) // 8) * 8  # `moe_capacity`'s slots per expert
    assert masked.max() <= C < unmasked.max()
