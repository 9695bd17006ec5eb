"""One truth: the stage ladder, the layouts, the routings and the kernel families exist once, and every reader
(the engine's configs, the cost model, the benchmarks) holds the very same objects; the import layers hold."""

import pathlib
import subprocess
import sys

import pytest

from qwen35_lib import config as config_lib
from qwen35_lib import get_config
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel import stages as cm_stages
from qwen35_lib.costmodel import step as cm_step
from qwen35_lib.kernels import registry
from qwen35_lib.parallel import layouts, stages


def test_the_cost_model_reads_the_one_stage_table():
    assert cm_stages.STAGES is stages.STAGES
    assert cm_stages.LADDER is stages.LADDER
    assert cm_stages.get_stage is stages.get_stage and cm_stages.custom_stage is stages.custom_stage
    assert cm_stages.ROUTINGS is config_lib.ROUTINGS and cm_stages.LAYOUTS is config_lib.LAYOUTS
    assert cm_stages.KERNELS is registry.FAMILIES
    from qwen35_lib import costmodel

    assert costmodel.STAGES is stages.STAGES


def test_bench_layouts_reads_the_one_stage_table():
    from qwen35_lib.bench import layouts as bench_layouts

    assert bench_layouts.stage_config is stages.stage_config


@pytest.mark.parametrize("name", stages.LADDER)
def test_each_stage_is_the_same_layout_and_kernels_in_code_and_cost_model(name):
    cfg = get_config("qwen3.5-397b-a17b")
    s = stages.get_stage(name)
    run = stages.stage_config(cfg, name, backend="tpu")
    lay = cm_stages.resolve_layout(s, cfg, 8)
    assert lay.name == run.layout == s.layout
    assert lay.moe == layouts.get_layout(run.layout).moe
    pl = cm_step.placement(cfg, specs_lib.get("tpu7x-8"), s)
    assert pl.attention == run.attention_kernel
    assert pl.moe_impl == {"pallas": "gmm"}.get(run.moe_kernel, run.moe_kernel)


def test_the_cost_model_refuses_what_the_engine_refuses_with_the_same_error():
    cfg = get_config("qwen3.5-397b-a17b")
    tp8 = stages.custom_stage("tp8")
    with pytest.raises(ValueError) as cost:
        cm_stages.resolve_layout(tp8, cfg, 8)
    with pytest.raises(ValueError) as code:
        layouts.check_layout(cfg.replace(layout="tp8"), cm_stages._mesh(8))
    assert str(cost.value) == str(code.value) and "'model'" not in str(cost.value)


def test_dp4_tp2_ep8_is_a_cost_model_layout_too():
    lay = cm_stages.resolve_layout(stages.custom_stage("dp4_tp2_ep8"), get_config("qwen3.5-397b-a17b"), 8)
    assert (lay.dp, lay.tp, lay.moe) == (4, 2, "ep")


def test_kernel_families_per_backend():
    assert registry.family_kernels("xla", "cpu")["moe_kernel"] == "capacity"
    assert registry.family_kernels("xla", "tpu")["moe_kernel"] == "ragged_dot"
    assert set(registry.family_kernels("pallas", "cpu").values()) == {"pallas"}
    assert set(registry.family_kernels("xla", "tpu")) == set(registry.CONFIG_FIELDS.values())
    with pytest.raises(ValueError, match="kernel family"):
        registry.family_kernels("cuda")


def test_the_model_takes_its_parallelism_and_never_looks_a_layout_up():
    import numpy as np

    from qwen35_lib import abstract_weights
    from qwen35_lib.model import forward as model_forward

    cfg = get_config("qwen3.5-tiny", layout="dp8_ep8")
    w = abstract_weights(cfg)  # refused before any weight is read
    with pytest.raises(ValueError, match="needs its parallelism"):
        model_forward(cfg, w, np.zeros((1, 4), np.int32))


def test_import_layers_contract():
    """pyproject.toml's import-linter layers (also `make lint`): nothing imports a layer above its own."""
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([pathlib.Path(sys.executable).parent / "lint-imports"], capture_output=True, text=True,
                         cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
