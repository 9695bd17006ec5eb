"""config.json problems get one-line `ConfigError`s (a ValueError) naming the file, the field and the fix.

Inputs are the tiny HF configs of `qwen35_lib.testing` with one field broken; each case used to load silently,
raise a ZeroDivisionError / AssertionError / TypeError, or name no file or field.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from qwen35_lib import testing  # noqa: E402
from qwen35_lib.config import ConfigError, from_hf_config, get_config  # noqa: E402

MODEL_TYPES = ("qwen3_5_moe", "qwen3_next")


def hf_dict(model_type: str) -> dict:
    return testing.tiny_hf_config(model_type).to_dict()


def refused(hf, match: str, **kwargs) -> str:
    with pytest.raises(ConfigError, match=match) as e:
        from_hf_config(hf, **kwargs)
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    return message


FIELD_CASES = [  # (field, value, the error); each for both model types
    ("num_key_value_heads", 0, r"num_key_value_heads is 0; it must be at least 1"),
    ("linear_num_key_heads", 0, r"linear_num_key_heads is 0; it must be at least 1"),
    ("num_hidden_layers", 0, r"num_hidden_layers is 0; it must be at least 1"),
    ("num_attention_heads", 3, r"num_attention_heads \(3\) is not a multiple of num_key_value_heads \(2\).*set "
                               r"num_key_value_heads to a divisor of 3"),
    ("linear_num_value_heads", 5, r"linear_num_value_heads \(5\) is not a multiple of linear_num_key_heads \(2\).*set "
                                  r"linear_num_key_heads to a divisor of 5"),
    ("num_experts_per_tok", 9, r"num_experts_per_tok \(9\) is more than num_experts \(8\); it must be in \[1, 8\]"),
    ("hidden_size", "64", r"hidden_size is '64' \(a string\); it must be an integer"),
    ("vocab_size", 256.0, r"vocab_size is 256.0 \(a number\); it must be an integer"),
    ("num_experts", True, r"num_experts is True \(a boolean\); it must be an integer"),
    ("moe_intermediate_size", [32], r"moe_intermediate_size is \[32\] \(a list\); it must be an integer"),
    ("head_dim", -32, r"head_dim is -32; it must be at least 1"),
    ("rms_norm_eps", "1e-6", r"rms_norm_eps is '1e-6' \(a string\); it must be a number"),
    ("rms_norm_eps", 0, r"rms_norm_eps is 0; it must be finite and above 0.0"),
    ("rms_norm_eps", json.loads("1e400"), r"rms_norm_eps is inf; it must be finite and above 0.0"),
    ("norm_topk_prob", 1, r"norm_topk_prob is 1 \(an integer\); it must be true or false"),
    ("layer_types", ["full_attention"] * 3, r"layer_types lists 3 layers but num_hidden_layers is 4"),
    ("layer_types", ["linear_attention"] * 3 + ["mamba"], r"layer_types holds 'mamba'; each entry must be"),
    ("layer_types", "full", r"layer_types is 'full' \(a string\); it must be a list of layer types"),
    ("eos_token_id", 256, r"eos_token_id holds 256, outside the vocabulary \[0, 256\)"),
    ("eos_token_id", "x", r"eos_token_id holds 'x' \(a string\); EOS ids must be integer token ids"),
    ("rope_parameters", {"rope_theta": "big"}, r"rope_parameters\.rope_theta is 'big' \(a string\)"),
    ("rope_parameters", {"rope_theta": 1e7, "partial_rotary_factor": 2},
     r"rope_parameters\.partial_rotary_factor is 2; it must be in \(0.0, 1.0\]"),
    ("rope_parameters", [1], r"rope_parameters is \[1\] \(a list\); it must be an object"),
    ("quantization_config", {"weight_block_size": [16, 8]},
     r"quantization_config has weight_block_size \[16, 8\], not square"),
    ("quantization_config", {"weight_block_size": [0, 0]},
     r"quantization_config has weight_block_size \[0, 0\]; it must be two"),
    ("dtype", 16, r"dtype is 16 \(an integer\); it must be a dtype name"),
]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("field, value, match", FIELD_CASES, ids=[f"{c[0]}={c[1]!r}"[:40] for c in FIELD_CASES])
def test_each_field(model_type, field, value, match):
    refused({**hf_dict(model_type), field: value}, rf"^config\.json: {match}")


def test_missing_field_and_nested_names():
    """A missing field is named; fields inside text_config are named `text_config.x`, the file by its path."""
    hf = hf_dict("qwen3_next")
    del hf["linear_key_head_dim"]
    refused(hf, r"config\.json: lacks the field 'linear_key_head_dim' needed for a qwen3_next model")
    text = {**hf_dict("qwen3_5_moe"), "num_key_value_heads": 0}
    refused({"model_type": "qwen3_5_moe", "text_config": text}, r"^x/config\.json: text_config\.num_key_value_heads is "
            r"0", source="x/config.json")
    text = {k: v for k, v in hf_dict("qwen3_5_moe").items() if k != "eos_token_id"}
    refused({"model_type": "qwen3_5_moe", "text_config": text, "eos_token_id": "x"},
            r"^config\.json: eos_token_id holds 'x'")  # a top-level field keeps its top-level name
    refused({"model_type": "qwen3_5_moe", "text_config": [1]}, r"'qwen3_5_moe' needs a 'text_config' object, found a "
                                                              r"list")
    refused({"model_type": "llama"}, r"unknown model_type 'llama'")


def test_not_an_object():
    refused([hf_dict("qwen3_next")], r"^config\.json: holds a list, not a JSON object of model fields")
    refused(3, r"holds an integer, not a JSON object")


def test_files(tmp_path):
    """Invalid JSON names the file, line and column; not UTF-8, a FIFO and a list are refused at once."""
    (tmp_path / "config.json").write_text('{\n  "model_type": "qwen3_next",\n  "vocab_size": 256,,\n}')
    path = re.escape(str(tmp_path / "config.json"))  # the second comma: line 3, column 21
    refused(tmp_path, rf"^{path}: invalid JSON at line 3, column 21: Expecting property name enclosed in double "
                      r"quotes; fix the config\.json there or download it again")
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    refused(tmp_path / "config.json", rf"^{path}: not UTF-8 text \(bad byte at offset 16\)")
    (tmp_path / "config.json").write_text('{"x": NaN}')
    refused(tmp_path, rf"^{path}: holds the constant NaN, which is not valid JSON")
    (tmp_path / "config.json").write_text("[]")
    refused(tmp_path, rf"^{path}: holds a list")
    os.unlink(tmp_path / "config.json")
    os.mkfifo(tmp_path / "config.json")
    refused(tmp_path / "config.json", rf"^{path}: not a regular file")
    with pytest.raises(FileNotFoundError, match="no config.json at"):
        from_hf_config(tmp_path / "nothing")


def test_unknown_changes_and_config_fields():
    """Config itself: a count of 0 and a wrong type are ConfigErrors naming the field (not ZeroDivisionError)."""
    refused(hf_dict("qwen3_next"), r"unknown Config fields \['bogus'\]; the fields are those of qwen35_lib\.config",
            bogus=1)
    for field, value, match in [("num_kv_heads", 0, r"num_kv_heads=0 must be at least 1"),
                                ("gdn_num_k_heads", 0, r"gdn_num_k_heads=0 must be at least 1"),
                                ("layer_pattern", (), r"layer_pattern is empty"),
                                ("num_layers", "4", r"Config field num_layers='4' is a str; it must be int"),
                                ("rope_theta", None, r"Config field rope_theta=None is a NoneType; it must be float")]:
        with pytest.raises(ConfigError, match=match):
            get_config("qwen3.5-tiny", **{field: value})
    assert isinstance(ConfigError("x"), ValueError)


def test_cli_prints_one_line(tmp_path):
    """The CLI's `except ValueError` shows a ConfigError as one `error:` line, exit status 2, no traceback."""
    (tmp_path / "config.json").write_text(json.dumps({**hf_dict("qwen3_next"), "num_key_value_heads": 0}))
    run = subprocess.run([sys.executable, "-m", "qwen35_lib", "info", "--model", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'config.json'}: num_key_value_heads is 0; it must be at least 1"], run.stderr
