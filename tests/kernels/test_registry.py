"""kernels.registry: the kernels listed per slot, unknown names or slots refused naming the choices, a kernel
registered for one block."""

import pytest

from qwen35_lib.kernels import available, get


def test_registry_lists_and_rejects():
    assert {"xla"} <= set(available("attention")) and {"ragged_dot", "capacity"} <= set(available("moe_matmul"))
    with pytest.raises(ValueError, match="no 'moe_matmul' kernel named 'nope'; available"):
        get("moe_matmul", "nope")
    with pytest.raises(ValueError, match="unknown kernel slot"):
        get("flash", "xla")


def test_registered_lasts_for_its_block_only():
    from qwen35_lib.kernels import registry

    spy = lambda *a, **k: None  # noqa: E731
    before = get("moe_matmul", "capacity")
    with registry.registered("moe_matmul", "spy", spy), registry.registered("moe_matmul", "capacity", spy):
        assert get("moe_matmul", "spy") is spy and get("moe_matmul", "capacity") is spy
    assert "spy" not in available("moe_matmul") and get("moe_matmul", "capacity") is before
    pallas = get("moe_matmul", "pallas", "cpu")  # a per-platform factory's kernel (interpret mode off a TPU)
    with registry.registered("moe_matmul", "pallas", spy):  # replaced by a plain kernel
        assert get("moe_matmul", "pallas", "cpu") is spy
    after = get("moe_matmul", "pallas", "cpu")  # the factory called again, not returned as the kernel
    assert (after.func, after.keywords) == (pallas.func, pallas.keywords)
    with pytest.raises(ValueError, match="unknown kernel slot"), registry.registered("flash", "x", spy):
        pass


def test_every_moe_matmul_implementation_is_documented():
    """The `moe_matmul` slot's names are the ones `kernels.moe`'s table documents (`kernels.moe.NAMES`), no more, and
    each registered implementation says what it is (its docstring, or its factory's)."""
    from qwen35_lib.kernels import moe, registry

    assert set(available("moe_matmul")) == set(moe.NAMES)
    for name in available("moe_matmul"):
        assert (registry._IMPLS["moe_matmul"][name].__doc__ or "").strip(), f"moe_matmul {name!r} has no docstring"
