"""Fixtures the kernel tests share."""

import jax
import pytest

from qwen35_lib import get_config, init_weights


@pytest.fixture(scope="module")
def tiny_moe():
    """qwen3.5-tiny's first MoE layer, float32, its router sharpened so that some experts get no tokens
    (moe/test_pallas.py defines its own, unsharpened)."""
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = jax.tree.map(lambda a: a[0, 0], init_weights(cfg, 3)["layers"]["moe"])
    w["router"] = w["router"] * 50
    return cfg, w
