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


def test_the_collective_flags_rule_is_the_records_and_every_check_reads_it():
    """`ServingPlan.collective_flags_apply` / `collective_flags_problem`: the flags apply to a data-parallel EP layout
    with routing 'replicate' only; `custom_stage` (the plan flags) refuses exactly what `bind` refuses, with the same
    message, and allows exactly what the rule allows."""
    mesh, cfg = plan_lib.abstract_mesh(8), get_config("qwen3.5-tiny")
    applies = set()
    for layout in plan_lib.LAYOUTS:
        lay = plan_lib.get_layout(layout)
        for routing in (None, "replicate", "all_to_all"):
            base = plan_lib.ServingPlan("x", layout, routing)
            if base.collective_flags_apply:
                applies.add((layout, routing))
            assert base.collective_flags_apply == (lay.moe == "ep" and lay.batch_axes is not None
                                                   and routing == "replicate")
            for flags in ((True, False), (False, True)):
                plan = base.replace(fuse_allgather=flags[0], hierarchical_rs=flags[1])
                problem = plan.collective_flags_problem()
                assert (problem is None) == base.collective_flags_apply
                try:
                    staged = plan_lib.custom_stage(layout, routing, *flags)
                except ValueError as e:
                    staged = str(e)
                ep_routing = routing if lay.moe == "ep" else None  # custom_stage drops a non-EP layout's routing
                want = plan.replace(routing=ep_routing).collective_flags_problem()
                assert staged == want if want else staged.fuse_allgather == flags[0], (layout, routing, staged)
                if want and layout != "single":  # bind's check (single is bound unchecked: one device, no flags)
                    try:
                        plan.replace(routing=ep_routing).bind(mesh if lay.devices != 1 else None, cfg)
                    except ValueError as e:
                        assert str(e) == want or "KV heads" in str(e) or "devices" in str(e), (layout, str(e))
                    else:
                        raise AssertionError(f"bind let {layout}/{routing} with {flags} through")
    assert ("dp8_ep8", "replicate") in applies and ("dp_tp2_ep", "replicate") in applies
    assert not {lay for lay, _ in applies} & {"tp8_ep8", "tp_ep", "tp8_kvrep", "single"}


def test_the_cost_models_candidates_set_the_flags_by_the_records_rule():
    from qwen35_lib.costmodel import choice

    for engine in choice.ENGINES:
        for routing in ("replicate", "all_to_all"):
            for plan in choice.candidates(routing, True, True, engine=engine):
                assert plan.fuse_allgather == plan.hierarchical_rs == plan.collective_flags_apply, plan
