"""bench.closed_loop: the zero-experts ablation kernel fuses where the measured kernel does, and a run's step split
(the whole step, the jitted part, the host rest) from its log."""

import pytest

from qwen35_lib.bench import closed_loop


def test_the_zero_experts_fuse_where_the_measured_kernel_does():
    import jax.numpy as jnp

    from qwen35_lib.kernels import get

    native, ragged = get("moe_matmul", "native"), get("moe_matmul", "ragged_dot")
    fused = closed_loop.zero_experts(native)
    assert fused.fuses is native.fuses and not hasattr(closed_loop.zero_experts(ragged), "fuses")
    x = jnp.ones((3, 4))
    assert not fused.fused(x, jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2)), 5, None, None).any()
    assert not fused(x, jnp.array([3], jnp.int32), None, None).any()


def test_step_split_is_the_jitted_step_and_the_host_rest():
    log = closed_loop.StepLog(wall=[0.010, 0.004, 0.006], device=[0.007, 0.003, 0.003])
    split = closed_loop.step_split(log, [0, 2])
    assert split["steps"] == 2
    assert split["wall_ms"] == pytest.approx({"p50": 8.0, "mean": 8.0})
    assert split["jitted_ms"] == pytest.approx({"p50": 5.0, "mean": 5.0})
    assert split["host_ms"] == pytest.approx({"p50": 3.0, "mean": 3.0})
    assert split["host_fraction"] == pytest.approx(6 / 16)
    assert closed_loop.step_split(log, []) is None and closed_loop.step_split(closed_loop.StepLog(), [0]) is None
