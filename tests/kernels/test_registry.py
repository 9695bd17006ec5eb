"""kernels.registry: the kernels listed per slot, and unknown names or slots refused naming the choices."""

import pytest

from qwen35_lib.kernels import available, get


def test_registry_lists_and_rejects():
    assert {"xla"} <= set(available("attention")) and {"ragged_dot", "tiled"} <= set(available("moe_matmul"))
    with pytest.raises(ValueError, match="no 'moe_matmul' kernel named 'nope'; available"):
        get("moe_matmul", "nope")
    with pytest.raises(ValueError, match="unknown kernel slot"):
        get("flash", "xla")
