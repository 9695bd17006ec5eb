"""Ahead-of-time compiles for TPU7x (`tpu7x:2x2x1`), with abstract weights: nothing is allocated. Each compile
runs in a child process (`aot_subprocess`): libtpu stays out of the pytest process. That the Pallas kernels lower
to Mosaic custom calls in a whole TPU7x step is checked on the kernels stage's step (`test_tpu_in_place.py`)."""

import aot_subprocess
import pytest

from qwen35_lib import get_config, model_stats

pytestmark = pytest.mark.tpu_compile
XLA_KERNELS = dict(attention_kernel="xla", gdn_kernel="xla", moe_kernel="ragged_dot")


def _topology() -> dict:
    from qwen35_lib.aot import chip_core_mesh, topology_devices

    topology = topology_devices()
    mesh = chip_core_mesh(topology)
    return dict(devices=len(topology), cores=sorted({d.core_on_chip for d in topology}), mesh=dict(mesh.shape),
                chip_rows=[len({tuple(d.coords) for d in row}) for row in mesh.devices])


def _forward(kernels: dict) -> dict:
    from qwen35_lib.aot import compile_forward
    from qwen35_lib.plan import SINGLE

    compiled = compile_forward(get_config("qwen3.5-mini"), batch=2, seq=256, plan=SINGLE.replace(**kernels))
    return dict(argument_bytes=compiled.memory_analysis().argument_size_in_bytes,
                flops=compiled.cost_analysis()["flops"])


@pytest.fixture(scope="module")
def tpu7x():
    return aot_subprocess.run({"topology": (_topology,), "xla": (_forward, XLA_KERNELS)})


def test_topology_is_tpu7x_8(tpu7x):
    t = tpu7x["topology"]
    assert t["devices"] == 8 and t["cores"] == [0, 1]
    assert t["mesh"] == {"chip": 4, "core": 2}
    assert all(n == 1 for n in t["chip_rows"])  # a row of the mesh = one chip


def test_mini_forward_compiles_for_tpu7x(tpu7x):
    cfg = get_config("qwen3.5-mini", **XLA_KERNELS)
    stats = model_stats(cfg)
    compiled = tpu7x["xla"]
    assert compiled["argument_bytes"] >= stats.weight_bytes
    # XLA counts 2 FLOPs per weight per token for every matmul except the routed experts: on TPU, ragged_dot is
    # a Mosaic kernel whose FLOPs cost_analysis() does not see (the cost model must add them itself).
    p = stats.params_by_part
    dense = stats.active_params - p["embed"] - p["routed_experts"] * cfg.num_experts_per_tok // cfg.num_experts
    assert compiled["flops"] >= 2 * (2 * 256) * dense
