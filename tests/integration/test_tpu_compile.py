"""Ahead-of-time compiles for TPU7x (`tpu7x:2x2x1`), with abstract weights: nothing is allocated. Each compile
runs in a child process (`aot_subprocess`): libtpu stays out of the pytest process. That the Pallas kernels lower
to Mosaic custom calls in a whole TPU7x step is checked on the kernels stage's step (`test_tpu_in_place.py`).

The mini forward runs 2 sequences of 64 tokens (one GDN chunk): its checks (the weights among the arguments, XLA's
FLOPs per token) do not depend on the length (FLOPs / the bound: 1.18 at 64 tokens and at 256), and libtpu compiled
it in 15-23 s instead of 41-54 s at 256 tokens (4 chunks; 37 s at 128) on the shared 2-core machine."""

import pytest

from qwen35_lib import get_config, model_stats
from tests import aot_subprocess

pytestmark = pytest.mark.tpu_compile
XLA_KERNELS = dict(attention_kernel="xla", gdn_kernel="xla", moe_kernel="ragged_dot")
BATCH, SEQ = 2, 64  # the mini forward's tokens (module doc)


def _topology() -> dict:
    from qwen35_lib.aot import chip_core_mesh, topology_devices

    topology = topology_devices()
    mesh = chip_core_mesh(topology)
    return dict(devices=len(topology), cores=sorted({d.core_on_chip for d in topology}), mesh=dict(mesh.shape),
                chip_rows=[len({tuple(d.coords) for d in row}) for row in mesh.devices])


def _forward(kernels: dict) -> dict:
    from qwen35_lib.aot import compile_forward
    from qwen35_lib.plan import SINGLE

    compiled = compile_forward(get_config("qwen3.5-mini"), batch=BATCH, seq=SEQ, plan=SINGLE.replace(**kernels))
    return dict(argument_bytes=compiled.memory_analysis().argument_size_in_bytes,
                flops=compiled.cost_analysis()["flops"])


@pytest.fixture(scope="module")
def tpu7x():
    from qwen35_lib.aot.validate import xla_bytes_accessed_factors

    return aot_subprocess.run({"topology": (_topology,), "xla": (_forward, XLA_KERNELS),
                               "factors": (xla_bytes_accessed_factors,)})


def test_topology_is_tpu7x_8(tpu7x):
    t = tpu7x["topology"]
    assert t["devices"] == 8 and t["cores"] == [0, 1]
    assert t["mesh"] == {"chip": 4, "core": 2}
    assert all(n == 1 for n in t["chip_rows"])  # a row of the mesh = one chip


def test_mini_forward_compiles_for_tpu7x(tpu7x):
    cfg = get_config("qwen3.5-mini")
    stats = model_stats(cfg)
    compiled = tpu7x["xla"]
    assert compiled["argument_bytes"] >= stats.weight_bytes
    # XLA counts 2 FLOPs per weight per token for every matmul except the routed experts: on TPU, ragged_dot is
    # a Mosaic kernel whose FLOPs cost_analysis() does not see (the cost model must add them itself).
    p = stats.params_by_part
    dense = stats.active_params - p["embed"] - p["routed_experts"] * cfg.num_experts_per_tok // cfg.num_experts
    assert compiled["flops"] >= 2 * (BATCH * SEQ) * dense


def test_xla_counts_a_reductions_input_and_a_dots_weight_five_times(tpu7x):
    # why costmodel.compiled compares the model with the HLO text's bytes (parallel.hlo.op_bytes), not with
    # cost_analysis()'s "bytes accessed": that count is no HBM traffic for a reduction or a dot
    f = {k: v["factor"] for k, v in tpu7x["factors"].items()}
    assert f["elementwise"] == pytest.approx(1.0, abs=0.01) and f["ragged_dot"] == pytest.approx(1.0, abs=0.01)
    assert f["reduce"] == pytest.approx(5.0, abs=0.05)
    w = 4096 * 4096 * 2  # the dot's right operand, counted five times, the rest once
    d = tpu7x["factors"]["dot, 8 rows"]
    assert d["xla"] == pytest.approx(d["op"] + 4 * w, rel=0.01)
    d = tpu7x["factors"]["dot, 4096 rows"]
    assert d["xla"] == pytest.approx(d["op"] + 4 * w, rel=0.01)
