"""plan.record: `bind` checks the plan itself against the model; `Config` holds no plan field."""

import dataclasses

import pytest

from qwen35_lib import config as config_lib
from qwen35_lib import get_config
from qwen35_lib import plan as plan_lib
from qwen35_lib.plan import kernels as plan_kernels


def test_bind_checks_the_plan_itself_against_the_model():
    cfg = get_config("qwen3.5-397b-a17b")  # the checkpoint's shapes only: the plan is checked against them
    lay = plan_lib.get_stage("fused_ag").bind(plan_lib.abstract_mesh(8), cfg)
    assert (lay.dp, lay.ep, lay.fuse_allgather, lay.name) == (8, 8, True, "fused_ag")
    with pytest.raises(ValueError, match="layout 'dp8_ep8' is the 8-device instance of 'dp_ep'"):
        plan_lib.get_stage("fused_ag").bind(plan_lib.abstract_mesh(4), cfg)


def test_config_is_the_checkpoints_shape_and_dtypes_only():
    """No plan field on `Config` (layout, routing, collective flags, capacity, kernels): those are the plan's, bound
    once per entry point; a plan refuses an unknown kernel family in one line."""
    fields = {f.name for f in dataclasses.fields(config_lib.Config)}
    plan_fields = {f.name for f in dataclasses.fields(plan_lib.ServingPlan)}
    assert not fields & {"layout", "routing", "fuse_allgather", "hierarchical_rs", "rs_micro_batches",
                         "capacity_factor", *plan_kernels.KERNEL_FIELDS.values()}
    assert {"capacity_factor", "rs_micro_batches", *plan_kernels.KERNEL_FIELDS.values()} <= plan_fields
    with pytest.raises(config_lib.ConfigError, match="unknown Config fields"):
        config_lib.from_hf_config(dict(model_type="qwen3_next"), layout="dp8_ep8")
    with pytest.raises(ValueError, match="unknown kernel family 'cuda'"):
        plan_lib.SINGLE.replace(kernels="cuda")
