"""qwen35_lib.checkpoint: every on-disk form of both model types loads to the HF model's weights (FP8 dequantized
and kept, dtypes, tied embeddings, `place`), and what the load itself refuses (non-finite weights, EOS ids that are
not tokens, a broken config.json).

The expected weights come from the HF model's own modules (`support.expected_weights`), not from the loader's code.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import safetensors_io, testing  # noqa: E402
from qwen35_lib.checkpoint import CheckpointError, load_hf_checkpoint, path_infos  # noqa: E402
from qwen35_lib.config import ConfigError, from_hf_config, get_config  # noqa: E402
from qwen35_lib.weights import declare, dequantize_fp8  # noqa: E402
from tests.checkpoint.support import (  # noqa: E402
    FORMS,
    MODEL_TYPES,
    NONFINITE,
    assert_weights_equal,
    edited,
    expected_weights,
    fuse_fp8_experts,
    one_line,
)

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning")]


@pytest.mark.parametrize("model_type, form", FORMS)
def test_load_every_form(ckpts, model_type, form):
    """Each form loads to the HF model's weights after the documented transforms (FP8: its round trip), exactly."""
    model, path = ckpts.model(model_type), ckpts(model_type, form)
    if form == "language_model":  # the vision tensors and the MTP head
        skipped = [n for n in testing.checkpoint_tensors(model, form) if n.startswith(("model.visual.", "mtp."))]
        with pytest.warns(UserWarning, match=f"skipped {len(skipped)} vision .* checkpoint.load_mtp"):
            config, weights = load_hf_checkpoint(path)
    else:
        config, weights = load_hf_checkpoint(path)
    assert config.model_type == model_type and config.dtype == "float32" and config.expert_dtype is None
    assert config.eos_token_ids == (1,) and config.name == path.name
    reference = testing.fp8_round_trip(model) if form.startswith("fp8") else model
    assert_weights_equal(config, weights, expected_weights(reference))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_config_matches_tiny_preset(model_type):
    """tiny_hf_config is our qwen3.5-tiny preset (from_hf_config reads every field)."""
    got = from_hf_config(testing.tiny_hf_config(model_type).to_dict())
    preset = get_config("qwen3.5-tiny")
    assert dataclasses.replace(got, name=preset.name, model_type=preset.model_type) == preset


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fp8_is_close_to_the_original(ckpts, model_type):
    """The FP8 round trip stays within e4m3's rounding (3 mantissa bits: relative error <= 2^-4) of the float32
    weights; this fails if scale_inv divided instead of multiplied or were applied to the wrong blocks."""
    config, weights = load_hf_checkpoint(ckpts(model_type, "fp8"))
    original = expected_weights(ckpts.model(model_type))
    changed = 0
    for path, leaf in path_infos(weights):
        w, got = original[path], np.asarray(leaf, np.float32)
        assert np.abs(got - w).max() <= 2**-4 * np.abs(w).max(), path
        changed += not np.array_equal(got, w)
    assert changed >= 10  # the linear weights really went through FP8


@pytest.mark.parametrize("model_type, fp8_block", [("qwen3_5_moe", 16), ("qwen3_next", 16), ("qwen3_5_moe", 24)])
def test_fp8_keep(ckpts, model_type, fp8_block):
    """fp8="keep": BlockFP8 experts in declare()'s layout whose dequantization is the dequantized load.
    Block 24 leaves partial blocks in both expert dims (64 = 24 + 24 + 16, 32 = 24 + 8)."""
    path = ckpts(model_type, "fp8", fp8_block=fp8_block)
    config, weights = load_hf_checkpoint(path, fp8="keep")
    assert config.expert_dtype == "float8_e4m3fn" and config.fp8_block_size == fp8_block
    plain_config, plain = load_hf_checkpoint(path)
    assert plain_config.expert_dtype is None
    declared = dict(path_infos(declare(config)))
    for p, leaf in path_infos(weights):
        assert (leaf.shape, leaf.dtype) == (declared[p].shape, declared[p].dtype), p
    for name in ("w_gate_up", "w_down"):
        dense = dequantize_fp8(weights["layers"]["moe"][name], fp8_block, jnp.float32)
        np.testing.assert_array_equal(np.asarray(dense), np.asarray(plain["layers"]["moe"][name]))
    np.testing.assert_array_equal(weights["layers"]["gdn"]["w_q"], plain["layers"]["gdn"]["w_q"])  # dequantized


def test_fp8_fused_experts(ckpts, tmp_path):
    """Fused FP8 experts (`gate_up_proj_scale_inv`) load like per-expert ones, dequantized and kept."""
    per_expert = ckpts("qwen3_5_moe", "fp8")
    fused = fuse_fp8_experts(per_expert, tmp_path / "fused_fp8")
    for fp8 in ("dequantize", "keep"):
        _, a = load_hf_checkpoint(per_expert, fp8=fp8)
        _, b = load_hf_checkpoint(fused, fp8=fp8)
        for (pa, la), (pb, lb) in zip(path_infos(a), path_infos(b), strict=True):
            assert pa == pb and la.dtype == lb.dtype
            np.testing.assert_array_equal(np.asarray(la, np.float32), np.asarray(lb, np.float32), err_msg=str(pa))


def test_dtype_policy(ckpts):
    """The checkpoint's dtype is kept (bf16 stays bf16, A_log / dt_bias float32) unless dtype= is given."""
    bf16_model = ckpts.model("qwen3_5_moe", "bfloat16")
    path = ckpts("qwen3_5_moe", "per_expert", "bfloat16")
    expected = expected_weights(bf16_model)
    config, weights = load_hf_checkpoint(path)
    assert config.dtype == "bfloat16" and weights["embed"].dtype == jnp.bfloat16
    assert weights["layers"]["gdn"]["A_log"].dtype == jnp.float32
    assert_weights_equal(config, weights, expected)
    config, weights = load_hf_checkpoint(path, dtype="float32")
    assert config.dtype == "float32"
    assert_weights_equal(config, weights, expected)  # bf16 -> float32 is exact
    config, weights = load_hf_checkpoint(ckpts("qwen3_5_moe", "fused"), dtype=jnp.bfloat16)
    assert config.dtype == "bfloat16"
    assert_weights_equal(config, weights, expected_weights(ckpts.model("qwen3_5_moe")))  # rounded to bf16


def test_tied_embeddings(ckpts):
    """With tie_word_embeddings, save_pretrained writes no lm_head and lm_head is the embedding, transposed."""
    path = ckpts("qwen3_5_moe", "per_expert", tie_word_embeddings=True)
    assert "lm_head.weight" not in safetensors_io.SafeTensorsFile(path / "model.safetensors")
    config, weights = load_hf_checkpoint(path)
    np.testing.assert_array_equal(np.asarray(weights["lm_head"]), np.asarray(weights["embed"]).T)
    model = ckpts.model("qwen3_5_moe", tie_word_embeddings=True)
    assert_weights_equal(config, weights, expected_weights(model))


def test_place_callback(ckpts):
    """`place` sees every declared leaf once, with its path and ArrayInfo, and its result is what is returned."""
    placed = {}

    def place(path, array, info):
        assert path not in placed
        assert isinstance(array, np.ndarray) and (array.shape, array.dtype) == (info.shape, info.dtype)
        placed[path] = jnp.asarray(array)
        return placed[path]

    config, weights = load_hf_checkpoint(ckpts("qwen3_next", "fp8"), fp8="keep", place=place)
    leaves = path_infos(weights)
    assert [p for p, _ in leaves] == [p for p, _ in path_infos(declare(config))]
    assert all(leaf is placed[p] for p, leaf in leaves)


def test_factory_per_expert_is_save_pretrained(ckpts):
    """checkpoint_tensors(per_expert) is exactly what save_pretrained wrote; HF reads back our other forms."""
    import transformers

    model = ckpts.model("qwen3_5_moe")
    written = safetensors_io.load_file(ckpts("qwen3_5_moe", "per_expert") / "model.safetensors")
    ours = testing.checkpoint_tensors(model, "per_expert")
    assert written.keys() == ours.keys()
    for name, w in ours.items():
        np.testing.assert_array_equal(written[name], w, err_msg=name)
    reference = model.state_dict()
    for form in ("fused", "language_model", "sharded"):
        back = transformers.AutoModelForCausalLM.from_pretrained(ckpts("qwen3_5_moe", form), dtype=torch.float32)
        for name, t in back.state_dict().items():
            torch.testing.assert_close(t, reference[name], rtol=0, atol=0, msg=f"{form}: {name}")


@pytest.mark.parametrize("name, index, value", NONFINITE)
def test_nonfinite_weights_are_refused(ckpts, tmp_path, name, index, value):
    """NaN / Inf weights used to give tokens [0, 0, 0]; they are refused, naming the tensor; check_weights=False
    loads them as they are."""
    src = ckpts("qwen3_5_moe", "per_expert")
    w = safetensors_io.load_file(src / "model.safetensors")[name]
    w[index] = value
    path = edited(src, tmp_path / "nan", add={name: w})
    with pytest.raises(CheckpointError, match=rf"nan: 1 tensors hold NaN or Inf values: {re.escape(name)} \(leaves "
                                              r".*check_weights=False \(CLI: --no-check-weights\)") as e:
        load_hf_checkpoint(path)
    one_line(e)
    _, weights = load_hf_checkpoint(path, check_weights=False)
    assert sum(int((~np.isfinite(np.asarray(leaf, np.float32))).sum()) for _, leaf in path_infos(weights)) >= 1


@pytest.mark.parametrize("eos, match", [
    ("x", r"holds 'x' \(a string\); EOS ids must be integer token ids"),
    (99999, r"holds 99999, outside the vocabulary \[0, 256\)"),
    ([1, True], r"holds True \(a boolean\)"),
    ([1, -1], r"holds -1, outside the vocabulary"),
    ({"id": 1}, r"holds \{'id': 1\} \(an object\)")])
def test_eos_ids_must_be_token_ids(ckpts, tmp_path, eos, match):
    path = shutil.copytree(ckpts("qwen3_5_moe", "fused"), tmp_path / "eos")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": eos}))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path / 'generation_config.json'))}: eos_token_id {match}"):
        load_hf_checkpoint(path)
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1, 7]}))
    assert load_hf_checkpoint(path)[0].eos_token_ids == (1, 7)


@pytest.mark.parametrize("text, match", [
    ('{"model_type": "qwen3_next",\n "vocab_size": 256,,\n}', r"invalid JSON at line 2, column 20: Expecting"),
    ('[{"model_type": "qwen3_next"}]', r"holds a list, not a JSON object of model fields"),
])
def test_broken_config_json_names_the_file(ckpts, tmp_path, text, match):
    path = shutil.copytree(ckpts("qwen3_next", "fused"), tmp_path / "cfg")
    (path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path / 'config.json'))}: {match}") as e:
        load_hf_checkpoint(path)
    one_line(e)


def test_config_json_fields_are_typed_at_load(ckpts, tmp_path):
    path = edited(ckpts("qwen3_next", "fused"), tmp_path / "t", config={"num_key_value_heads": 0})
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path / 'config.json'))}: num_key_value_heads is 0; it"):
        load_hf_checkpoint(path)
    path = edited(ckpts("qwen3_next", "fused"), tmp_path / "tie", config={"tie_word_embeddings": "no"})
    with pytest.raises(ConfigError, match="tie_word_embeddings is 'no'; it must be true or false"):
        load_hf_checkpoint(path)

