"""plan.bound: `bind` returns a BoundPlan (sizes, platform, one implementation per slot, the placed config, the cache
dtypes) and leaves the plan as asked; `BoundPlan.bound` is the one "already bound here?" test."""

import pytest

from qwen35_lib import get_config
from qwen35_lib import plan as plan_lib


def test_bind_resolves_each_slot_and_keeps_the_plan_as_asked():
    asked = plan_lib.get_stage("kernels").replace(moe_kernel="auto", gdn_kernel="xla")
    run = asked.bind(plan_lib.abstract_mesh(8), get_config("qwen3.5-tiny"), platform="tpu")
    assert isinstance(run, plan_lib.BoundPlan) and run.plan is asked and asked.moe_kernel == "auto"
    assert (run.kernel("moe_matmul"), run.kernel("gdn"), run.platform) == ("pallas", "xla", "tpu")
    assert run.kernel_names["moe_kernel"] == "pallas" and run.moe_kernel == "auto"  # what was asked reads through
    assert (run.dp, run.ep, run.tp, run.mesh_shape) == (8, 8, 1, (("chip", 4), ("core", 2)))


def test_the_placed_config_and_cache_dtypes_are_bound_once():
    cfg = get_config("qwen3.5-tiny").replace(num_q_heads=8)  # 4 query heads per KV head: tp8_kvrep keeps 4 copies
    run = plan_lib.get_layout("tp8_kvrep").bind(plan_lib.abstract_mesh(8), cfg, kv_dtype="float8_e4m3fn")
    assert run.config.num_kv_heads == 8 and run.placed() is run.config and run.placed(cfg) is run.config
    assert run.place(run.config) == run.config  # placing a placed config changes nothing
    assert (run.kv_dtype, run.gdn_state_dtype) == ("float8_e4m3fn", cfg.gdn_state_dtype)
    own = plan_lib.SINGLE.replace(kv_dtype="bfloat16", gdn_state_dtype="bfloat16").bind(None, cfg,
                                                                                        kv_dtype="float8_e4m3fn")
    assert (own.kv_dtype, own.config.gdn_state_dtype) == ("bfloat16", "bfloat16")  # the plan's own win
    with pytest.raises(ValueError, match="was bound without a model: bind it with one"):
        plan_lib.get_layout("dp_ep").bind(plan_lib.abstract_mesh(4)).placed()


def test_bound_keeps_a_plan_bound_there_and_rebinds_elsewhere():
    cfg = get_config("qwen3.5-tiny")
    run = plan_lib.get_stage("dp_ep").bind(plan_lib.abstract_mesh(8), cfg, platform="tpu")
    assert run.bound(plan_lib.abstract_mesh(8), cfg) is run
    assert run.bound(plan_lib.abstract_mesh(8), cfg, kv_dtype="float8_e4m3fn").kv_dtype == "float8_e4m3fn"
    assert run.bound(plan_lib.abstract_mesh(8), cfg, platform="cpu").kernel("moe_matmul") == "native"
    assert run.on_devices(8) is run and run.on_devices(4).layout == "dp_ep"
    with pytest.raises(ValueError, match="is the 8-device instance of 'dp_ep'"):
        run.bound(plan_lib.abstract_mesh(4), cfg)


def test_placed_keeps_what_config_equality_ignores():
    """`Config` equality ignores the name and the EOS ids: a config equal to the bound model but with its own EOS ids
    (a checkpoint's generation_config) is placed as given, not swapped for the bound one."""
    cfg = get_config("qwen3.5-tiny")
    run = plan_lib.SINGLE.bind(None, cfg)
    other = cfg.replace(eos_token_ids=(7,))
    assert other == cfg and run.placed(other).eos_token_ids == (7,) and run.placed(cfg) is run.config
