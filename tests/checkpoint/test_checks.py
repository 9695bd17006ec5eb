"""checkpoint.checks: what is refused before any byte is read (missing, misshapen, leftover tensors, integers for
float weights), each error naming the problem and the fix; float-to-float casts said once."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import safetensors_io  # noqa: E402
from qwen35_lib.checkpoint import CheckpointError, load_hf_checkpoint  # noqa: E402
from tests.checkpoint.support import edited, one_line  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning")]


def test_missing_tensors_are_listed(ckpts, tmp_path):
    src = ckpts("qwen3_5_moe", "per_expert")
    path = edited(src, tmp_path / "one", drop=["model.layers.2.linear_attn.in_proj_z.weight"])
    with pytest.raises(ValueError, match=r"1 tensors that config.json implies are missing: "
                                         r"model\.layers\.2\.linear_attn\.in_proj_z\.weight\. Check"):
        load_hf_checkpoint(path)
    experts = [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")]
    path = edited(src, tmp_path / "many", drop=experts)
    with pytest.raises(ValueError, match=r"24 tensors .* missing: .*experts\.4\.up_proj\.weight \.\.\. and 14 more"):
        load_hf_checkpoint(path)
    path = edited(ckpts("qwen3_next", "fp8"), tmp_path / "scale",
                   drop=["model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv"])
    with pytest.raises(ValueError, match=r"missing: model\.layers\.0\.linear_attn\.in_proj_qkvz\.weight_scale_inv"):
        load_hf_checkpoint(path)


def test_shape_mismatch(ckpts, tmp_path):
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    path = edited(ckpts("qwen3_5_moe", "per_expert"), tmp_path / "t", add={name: np.zeros((96, 60), np.float32)})
    with pytest.raises(ValueError, match=rf"{name}: config.json implies \(96, 64\), the file has \(96, 60\)"):
        load_hf_checkpoint(path)
    path = edited(ckpts("qwen3_next", "fused"), tmp_path / "c", config={"moe_intermediate_size": 40})
    with pytest.raises(ValueError, match=r"disagree .*gate_up_proj: config.json implies \(8, 80, 64\), the file has"):
        load_hf_checkpoint(path)


def test_leftover_tensors(ckpts, tmp_path):
    path = edited(ckpts("qwen3_5_moe", "per_expert"), tmp_path / "x",
                   add={"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"1 tensors are neither .*: model\.layers\.0\.mlp\.extra\.weight"):
        load_hf_checkpoint(path)
    path = edited(ckpts("qwen3_5_moe", "per_expert"), tmp_path / "nl", add={"a\nb" * 100: np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"1 tensors are neither .*: 'a\\nba\\nb.*\.\.\.\. Is config") as e:
        load_hf_checkpoint(path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 600  # a header's name is shown escaped and cut


@pytest.mark.parametrize("name, stored", [("lm_head.weight", np.int32), ("model.norm.weight", np.uint8),
                                          ("model.layers.3.self_attn.k_norm.weight", np.bool_)])
def test_integer_tensors_for_float_weights_are_refused(ckpts, tmp_path, name, stored):
    """An I32 lm_head used to be cast to zeros (every token 0); a stored kind other than the weight's is refused."""
    src = ckpts("qwen3_5_moe", "per_expert")
    shape = safetensors_io.SafeTensorsFile(src / "model.safetensors").tensors[name].shape
    path = edited(src, tmp_path / "int", add={name: np.ones(shape, stored)})
    st_name = safetensors_io.NAMES[np.dtype(stored)]
    with pytest.raises(CheckpointError, match=rf"1 tensors hold another kind of number than their weight: "
                                              rf"{re.escape(name)} is stored as {st_name} \((int|bool)s\), but its "
                                              rf"weight is float32\. A cast would make them garbage") as e:
        load_hf_checkpoint(path)
    one_line(e)


def test_float_casts_are_allowed_and_said_once(ckpts, caplog):
    """BF16 stored, float32 declared: loaded exactly, and one logged line per load counts the casts."""
    path = ckpts("qwen3_5_moe", "per_expert", "bfloat16")
    count = len(safetensors_io.SafeTensorsFile(path / "model.safetensors").tensors)
    with caplog.at_level(logging.WARNING, logger="qwen35_lib.checkpoint"):
        load_hf_checkpoint(path, dtype="float32")
        notes = [r.getMessage() for r in caplog.records if r.name == "qwen35_lib.checkpoint"]
        assert notes == [f"note: {path}: {count} tensors are cast to their weights' dtype ({count} x BF16 -> float32)"]
        caplog.clear()
        load_hf_checkpoint(ckpts("qwen3_5_moe", "per_expert"))  # float32 stored and declared: nothing to say
        assert not [r for r in caplog.records if r.name == "qwen35_lib.checkpoint"]

