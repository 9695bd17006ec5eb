"""One truth: the stage ladder, the layouts, the routings and the kernel families exist once, and every reader
(the engine's configs, the cost model, the benchmarks) holds the very same objects; the import layers hold."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from qwen35_lib import config as config_lib
from qwen35_lib import get_config
from qwen35_lib import plan as plan_lib
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel import step as cm_step
from qwen35_lib.kernels import registry
from qwen35_lib.plan import kernels as plan_kernels


def test_one_stage_table_in_the_plan_package():
    """The ladder and its extras live in `qwen35_lib.plan` alone: no other `stages` module, no re-export."""
    from qwen35_lib import costmodel

    assert not hasattr(config_lib, "LAYOUTS") and not hasattr(config_lib, "ROUTINGS")
    assert registry.SLOTS is plan_kernels.SLOTS
    assert set(plan_lib.EXTRA) == {"google_baseline", "tpu_inference_3050"}
    lib = pathlib.Path(plan_lib.__file__).parents[1]
    assert [p.relative_to(lib).as_posix() for p in lib.rglob("stages.py")] == ["plan/stages.py"]
    assert not hasattr(costmodel, "STAGES") and not hasattr(registry, "FAMILIES")


@pytest.mark.parametrize("name", plan_lib.LADDER)
def test_each_stage_is_the_same_layout_and_kernels_in_code_and_cost_model(name):
    cfg = get_config("qwen3.5-397b-a17b")
    s = plan_lib.get_stage(name)
    run = s.bind(plan_lib.abstract_mesh(8), cfg, platform="tpu")  # what the engine and aot run on TPU7x-8
    lay = cm_step.bind_to(s, cfg, specs_lib.get("tpu7x-8"))  # what the cost model prices
    assert lay == run and lay.layout == s.layout
    unbound = dict(mesh_shape=None, platform=None, **dict.fromkeys(plan_kernels.KERNEL_FIELDS.values()))
    assert dataclasses.replace(lay, **unbound) == s  # the stage itself, bound to the 8-device mesh
    assert lay.moe == plan_lib.get_layout(run.layout).moe
    pl = cm_step.placement(cfg, specs_lib.get("tpu7x-8"), s)
    assert pl.attention == run.kernel("attention")
    assert pl.moe_impl == {"pallas": "gmm"}.get(run.kernel("moe_matmul"), run.kernel("moe_matmul"))


def test_the_cost_model_refuses_what_the_engine_refuses_with_the_same_error():
    cfg = get_config("qwen3.5-397b-a17b")
    tp8 = plan_lib.custom_stage("tp8")
    with pytest.raises(ValueError) as cost:
        cm_step.bind_to(tp8, cfg, specs_lib.get("tpu7x-8"))
    with pytest.raises(ValueError) as code:
        plan_lib.get_layout("tp8").bind(plan_lib.make_mesh(), cfg)
    assert str(cost.value) == str(code.value) and "'model'" not in str(cost.value)


def test_bind_checks_the_plan_itself_against_the_model():
    cfg = get_config("qwen3.5-397b-a17b")  # the checkpoint's shapes only: the plan is checked against them
    lay = plan_lib.get_stage("fused_ag").bind(plan_lib.abstract_mesh(8), cfg)
    assert (lay.dp, lay.ep, lay.fuse_allgather, lay.name) == (8, 8, True, "fused_ag")
    with pytest.raises(ValueError, match="layout 'dp8_ep8' is the 8-device instance of 'dp_ep'"):
        plan_lib.get_stage("fused_ag").bind(plan_lib.abstract_mesh(4), cfg)


def test_dp4_tp2_ep8_is_a_cost_model_layout_too():
    lay = cm_step.bind_to(plan_lib.custom_stage("dp4_tp2_ep8"), get_config("qwen3.5-397b-a17b"),
                          specs_lib.get("tpu7x-8"))
    assert (lay.dp, lay.tp, lay.ep, lay.moe) == (4, 2, 8, "ep")


def test_one_plan_class_for_layouts_stages_and_the_cost_model():
    assert all(plan_lib.get_layout(n) is plan_lib.LAYOUT_PLANS[n] for n in plan_lib.LAYOUTS)
    assert all(type(s) is plan_lib.ServingPlan for s in (*plan_lib.STAGES.values(), *plan_lib.EXTRA.values()))


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_general_and_8_device_names_are_one_placement(devices):
    cfg = get_config("qwen3.5-397b-a17b")
    for name, general in plan_lib.INSTANCES.items():
        assert plan_lib.get_layout(name).rules is plan_lib.get_layout(general).rules
    for s in plan_lib.STAGES.values():  # on other device counts the cost model runs the stage's general form
        lay = s.on_devices(devices).bind(plan_lib.abstract_mesh(devices), cfg)
        assert lay.layout == (s.layout if devices == 8 else "single" if devices == 1 else s.general)
        assert lay.dp * (lay.tp if lay.moe == "tp" else 1) <= devices and lay.name == s.name


def test_kernel_families_per_backend():
    assert plan_lib.family_kernels("xla", "cpu")["moe_kernel"] == "loop"
    assert plan_lib.family_kernels("xla", "tpu")["moe_kernel"] == "ragged_dot"
    assert set(plan_lib.family_kernels("pallas", "cpu").values()) == {"pallas"}
    assert set(plan_lib.family_kernels("xla", "tpu")) == set(plan_kernels.KERNEL_FIELDS.values())
    with pytest.raises(ValueError, match="kernel family"):
        plan_lib.family_kernels("cuda")


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


def test_import_layers_contract():
    """pyproject.toml's import-linter layers (also `make lint`): nothing imports a layer above its own."""
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([pathlib.Path(sys.executable).parent / "lint-imports"], capture_output=True, text=True,
                         cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_budget_placement_aot_and_bench_read_the_same_plan_objects():
    from qwen35_lib import budget, placement
    from qwen35_lib.bench import layouts as bench_layouts
    from qwen35_lib.parallel import parallelism

    assert budget.LAYOUT_OF["experts_sharded"] is plan_lib.LAYOUT_PLANS["dp_ep"]
    assert placement.get_layout is plan_lib.get_layout
    assert bench_layouts.STAGES is plan_lib.STAGES
    assert set(bench_layouts.STAGE_NAMES) == {n for n, s in plan_lib.STAGES.items() if s.kernels == "xla"}
    cfg = get_config("qwen3.5-mini")
    mesh = plan_lib.make_mesh()
    for s in plan_lib.STAGES.values():  # the bound plan is the stage, handed down as it is
        p = s.bind(mesh, cfg)
        assert parallelism.parallelism(p).plan is p
        assert (p.layout, p.routing, p.fuse_allgather, p.hierarchical_rs) == \
               (s.layout, s.routing, s.fuse_allgather, s.hierarchical_rs)
        assert p.rules is plan_lib.get_layout(s.layout).rules


def test_a_plans_cache_dtypes_reach_the_cost_model():
    from qwen35_lib import costmodel

    base = plan_lib.get_stage("kernels")
    bf16 = dataclasses.replace(base, name="kernels/bf16", kv_dtype="bfloat16", gdn_state_dtype="bfloat16")
    a = costmodel.predict(stage=base, isl=1024, osl=1024, concurrency=8)
    b = costmodel.predict(stage=bf16, isl=1024, osl=1024, concurrency=8)
    c = costmodel.predict(stage=base, isl=1024, osl=1024, concurrency=8, kv_dtype="bfloat16")
    assert (a["kv_dtype"], b["kv_dtype"], c["kv_dtype"]) == ("float8_e4m3fn", "bfloat16", "bfloat16")
    assert bf16.placed_config(get_config("qwen3.5-mini")).gdn_state_dtype == "bfloat16"


@pytest.mark.parametrize("where", ["stage_gain", "viz"])
def test_every_grouping_of_the_cost_breakdown_covers_each_component_once(where):
    from qwen35_lib.costmodel.step import COMPONENTS

    if where == "stage_gain":
        from qwen35_lib.stage_gain import GROUPS
    else:
        from qwen35_lib.viz.costmodel import GROUPS
    grouped = [c for parts in GROUPS.values() for c in parts]
    assert sorted(grouped) == sorted(COMPONENTS), f"{where}.GROUPS must list each costmodel.step component once"
