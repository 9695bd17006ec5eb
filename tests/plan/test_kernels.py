"""plan.kernels: each kernel family's kernels per backend, and an unknown family refused."""

import pytest

from qwen35_lib import plan as plan_lib
from qwen35_lib.plan import kernels as plan_kernels


def test_kernel_families_per_backend():
    assert plan_lib.family_kernels("xla", "cpu")["moe_kernel"] == "native"
    assert plan_lib.family_kernels("xla", "tpu")["moe_kernel"] == "ragged_dot"
    assert plan_lib.family_kernels("xla", "cpu")["gdn_kernel"] == "native"
    assert plan_lib.family_kernels("xla", "tpu")["gdn_kernel"] == "xla"
    assert plan_lib.family_kernels("xla", "cpu")["attention_kernel"] == "items"
    assert plan_lib.family_kernels("xla", "tpu")["attention_kernel"] == "items"  # the twin where items cost more
    assert set(plan_lib.family_kernels("pallas", "cpu").values()) == {"pallas"}
    assert set(plan_lib.family_kernels("xla", "tpu")) == set(plan_kernels.KERNEL_FIELDS.values())
    with pytest.raises(ValueError, match="kernel family"):
        plan_lib.family_kernels("cuda")
