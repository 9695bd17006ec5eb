"""One truth: the stage ladder, the layouts, the routings and the kernel families exist once, and every reader
(the engine's configs, the cost model, the benchmarks) holds the very same objects; the import layers hold."""

import dataclasses
import importlib
import pathlib
import subprocess
import sys

import jax
import pytest

from qwen35_lib import get_config
from qwen35_lib import plan as plan_lib
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel import step as cm_step
from qwen35_lib.plan import kernels as plan_kernels


def test_one_stage_table_in_the_plan_package():
    """The ladder and its extras live in `qwen35_lib.plan` alone: no other `stages` module."""
    assert set(plan_lib.EXTRA) == {"google_baseline", "tpu_inference_3050", "fused_ep"}
    lib = pathlib.Path(plan_lib.__file__).parents[1]
    assert [p.relative_to(lib).as_posix() for p in lib.rglob("stages.py")] == ["plan/stages.py"]


@pytest.mark.parametrize("name", plan_lib.LADDER)
def test_each_stage_is_the_same_layout_and_kernels_in_code_and_cost_model(name):
    cfg = get_config("qwen3.5-397b-a17b")
    s = plan_lib.get_stage(name)
    run = s.bind(plan_lib.abstract_mesh(8), cfg, platform="tpu")  # what the engine and aot run on TPU7x-8
    lay = cm_step.bind_to(s, cfg, specs_lib.get("tpu7x-8"))  # what the cost model prices
    assert lay == run and lay.layout == s.layout
    assert lay.plan is s  # the stage itself, as asked, bound to the 8-device mesh
    assert set(dict(lay.impls)) == set(plan_kernels.SLOTS)
    assert lay.moe == plan_lib.get_layout(run.layout).moe
    pr = cm_step.pricing(cfg, specs_lib.get("tpu7x-8"), s)
    assert pr.attention == run.kernel("attention")
    assert pr.moe_impl == run.kernel("moe_matmul")  # the cost model keys by implementation


def test_the_cost_model_refuses_what_the_engine_refuses_with_the_same_error():
    cfg = get_config("qwen3.5-397b-a17b")
    tp8 = plan_lib.custom_stage("tp8")
    with pytest.raises(ValueError) as cost:
        cm_step.bind_to(tp8, cfg, specs_lib.get("tpu7x-8"))
    with pytest.raises(ValueError) as code:
        plan_lib.get_layout("tp8").bind(plan_lib.make_mesh(), cfg)
    assert str(cost.value) == str(code.value) and "'model'" not in str(cost.value)


def test_dp4_tp2_ep8_is_a_cost_model_layout_too():
    lay = cm_step.bind_to(plan_lib.custom_stage("dp4_tp2_ep8"), get_config("qwen3.5-397b-a17b"),
                          specs_lib.get("tpu7x-8"))
    assert (lay.dp, lay.tp, lay.ep, lay.moe) == (4, 2, 8, "ep")


def test_import_layers_contract():
    """pyproject.toml's import-linter layers (also `make lint`): nothing imports a layer above its own."""
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([pathlib.Path(sys.executable).parent / "lint-imports"], capture_output=True, text=True,
                         cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_budget_bench_and_the_model_read_the_same_plan_objects():
    from qwen35_lib import budget
    from qwen35_lib.bench import layouts as bench_layouts
    from qwen35_lib.parallel import parallelism

    assert budget.SPREAD_PLANS["experts_sharded"] is plan_lib.LAYOUT_PLANS["dp_ep"]
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
    run = bf16.bind(plan_lib.abstract_mesh(8), get_config("qwen3.5-mini"), kv_dtype="float8_e4m3fn")
    assert (run.kv_dtype, run.gdn_state_dtype, run.config.gdn_state_dtype) == ("bfloat16",) * 3  # the plan's win


@pytest.mark.parametrize("where", ["stage_gain", "viz"])
def test_every_grouping_of_the_cost_breakdown_covers_each_component_once(where):
    from qwen35_lib.costmodel.step import COMPONENTS

    if where == "stage_gain":
        from qwen35_lib.stage_gain import GROUPS
    else:
        from qwen35_lib.viz.costmodel import GROUPS
    grouped = [c for parts in GROUPS.values() for c in parts]
    assert sorted(grouped) == sorted(COMPONENTS), f"{where}.GROUPS must list each costmodel.step component once"


@pytest.mark.parametrize("layout", ["dp8_ep8", "tp8_kvrep", "dp4_tp2_ep8", "single"])
def test_every_bytes_per_device_is_checked_against_the_one_reference(layout):
    """`costmodel.traffic.resident_bytes` is the reference of the bytes one device holds (each declared weight and
    cache leaf of the bound plan's placed config over the ways the plan splits it); every other computation of them
    is checked against it here: the sweep's (JAX's shard shapes of the abstract arrays), the placement explorer's,
    the engine's cache check's (`engine.cache.device_cache_bytes`) and the cost model's priced pools."""
    from qwen35_lib import placement as placement_lib
    from qwen35_lib.aot import sweep
    from qwen35_lib.costmodel import traffic
    from qwen35_lib.engine.cache import device_cache_bytes

    cfg, devices = get_config("qwen3.5-tiny"), 1 if layout == "single" else 8
    predict_lib = importlib.import_module("qwen35_lib.costmodel.predict")  # the module, not the package's function
    mesh = plan_lib.make_mesh(jax.devices()[:devices])
    plan = plan_lib.get_layout(layout).bind(mesh, cfg, kv_dtype="float8_e4m3fn")
    shape = sweep.ServingShape(requests=16, context_len=64, page_size=16, kv_dtype="float8_e4m3fn")
    cache = sweep.cache_shape(shape, plan, mesh)
    ref = traffic.resident_bytes(plan, cfg, cache)
    assert sweep.resident(plan.placed(), plan, shape, mesh) == dict(weight_bytes=ref["weights"], kv_bytes=ref["kv"],
                                                                   gdn_state_bytes=ref["gdn_state"])
    p = placement_lib.placement(cfg, layout, devices, "float8_e4m3fn", requests=16, context_len=64, page_size=16)
    assert (p.weight_bytes_per_device, p.kv_bytes_per_device, p.gdn_state_bytes_per_device) == \
           (ref["weights"], ref["kv"], ref["gdn_state"])
    held = device_cache_bytes(plan.placed(), cache, None if layout == "single" else mesh, plan)
    assert set(held.values()) == {ref["kv"] + ref["gdn_state"]}
    priced = predict_lib.resident_bytes_per_device(cfg, specs_lib.get("tpu7x-8" if devices == 8 else "h200"),
                                                   plan_lib.get_layout(layout), 16 // plan.dp, 64, "float8_e4m3fn", 16)
    assert priced == dict(weight_bytes=ref["weights"], kv_bytes=ref["kv"], gdn_state_bytes=ref["gdn_state"])
