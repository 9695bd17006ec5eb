"""checkpoint.names: the groups read every HF tensor once, whatever the form."""

from __future__ import annotations

import collections
import contextlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import safetensors_io, testing  # noqa: E402
from qwen35_lib.checkpoint import load_hf_checkpoint  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning")]


@pytest.mark.parametrize("model_type, form, fp8", [
    ("qwen3_5_moe", "sharded", "dequantize"), ("qwen3_5_moe", "language_model", "dequantize"),
    ("qwen3_next", "fp8", "dequantize"), ("qwen3_next", "fp8", "keep"), ("qwen3_5_moe", "per_expert", "dequantize")])
def test_each_tensor_read_once(ckpts, model_type, form, fp8, monkeypatch):
    """Every text tensor (and FP8 scale) is fetched exactly once; skipped vision / MTP tensors never."""
    path = ckpts(model_type, form)
    reads = collections.Counter()
    monkeypatch.setattr(safetensors_io, "READ_HOOKS", [lambda file, name: reads.update([name])])
    with pytest.warns(UserWarning, match="skipped") if form == "language_model" else contextlib.nullcontext():
        load_hf_checkpoint(path, fp8=fp8)
    names = set(testing.checkpoint_tensors(ckpts.model(model_type), form))
    skipped = {n for n in names if n.startswith(("model.visual.", "mtp."))}
    assert reads.keys() == names - skipped
    assert set(reads.values()) == {1}



def test_path_infos_name_leaves_by_dict_keys_and_fp8_fields():
    from qwen35_lib.checkpoint import path_infos
    from qwen35_lib.config import get_config
    from qwen35_lib.weights import declare

    c = get_config("qwen3.5-tiny", expert_dtype="float8_e4m3fn")
    paths = [p for p, _ in path_infos(declare(c))]
    assert ("embed",) in paths and ("layers", "gdn", "w_q") in paths
    assert ("layers", "moe", "w_gate_up", "value") in paths and ("layers", "moe", "w_gate_up", "scale") in paths
    assert len(paths) == len(set(paths))
