"""checkpoint.sliced: with a mesh every leaf lands straight in its shards, the unsharded load's values; non-finite
FP8 scales and sharded leaves are named."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import safetensors_io  # noqa: E402
from qwen35_lib.checkpoint import CheckpointError, load_hf_checkpoint, path_infos  # noqa: E402
from tests.checkpoint.support import edited  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning")]


@pytest.mark.parametrize("layout,fp8", [("dp8_ep8", "keep"), ("tp8_kvrep", "dequantize")])
def test_load_straight_into_shards(ckpts, layout, fp8):
    """With `mesh`, each leaf lands in its shards: device 0 holds 1/8 of the experts (EP) or of the expert FFN
    (TP), the values are the unsharded load's, and the sharded model runs under the mesh."""
    import jax

    from qwen35_lib import forward
    from qwen35_lib.parallel import weight_shardings
    from qwen35_lib.plan import get_layout, make_mesh

    path = ckpts("qwen3_5_moe", "fp8")
    mesh = make_mesh()
    config, sharded = load_hf_checkpoint(path, fp8=fp8, dtype="float32", mesh=mesh, layout=layout)
    plan = get_layout(layout).bind(mesh, config)
    _, plain = load_hf_checkpoint(path, fp8=fp8, dtype="float32")
    want = weight_shardings(config, plan, mesh)
    for (p, a), (_, b), (_, s) in zip(path_infos(sharded), path_infos(plain), path_infos(want)):
        assert a.sharding.is_equivalent_to(s, a.ndim), p
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
    w_down = sharded["layers"]["moe"]["w_down"]  # [G, P, E, F, D]
    w_down = w_down.value if fp8 == "keep" else w_down
    shard = w_down.addressable_shards[0].data.shape
    E, F = config.num_experts, config.moe_ffn
    assert shard[2:4] == ((E // 8, F) if layout == "dp8_ep8" else (E, F // 8))
    tokens = np.arange(1, 9, dtype=np.int32)[None]
    with jax.set_mesh(mesh):
        out = forward(config, sharded, tokens, plan=plan)
    np.testing.assert_allclose(np.asarray(out), np.asarray(forward(config, plain, tokens)),
                               atol=2e-5, rtol=1e-5)  # float32; only the order of the expert sums differs


def test_nonfinite_fp8_scale_and_sharded_leaves(ckpts, tmp_path):
    """A NaN FP8 scale is named (its weight dequantizes to NaN); a NaN expert is found on sharded leaves too."""
    src = ckpts("qwen3_next", "fp8")
    scale = "model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv"
    s = safetensors_io.load_file(src / "model.safetensors")[scale]
    s[1, 2] = np.nan
    path = edited(src, tmp_path / "scale", add={scale: s})
    with pytest.raises(CheckpointError, match=rf"1 tensors hold NaN or Inf values: {re.escape(scale)} \(leaves "):
        load_hf_checkpoint(path)
    from qwen35_lib.plan import make_mesh

    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    src = ckpts("qwen3_5_moe", "per_expert")
    w = safetensors_io.load_file(src / "model.safetensors")[name]
    w[2, 3] = np.nan
    path = edited(src, tmp_path / "sharded", add={name: w})
    with pytest.raises(CheckpointError, match=rf"1 tensors hold NaN or Inf values: {re.escape(name)} \(leaves "
                                              r"layers/moe/w_gate_up\)"):
        load_hf_checkpoint(path, mesh=make_mesh(), layout="dp8_ep8")

