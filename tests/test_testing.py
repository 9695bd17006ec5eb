"""The test factory's parts that need no torch (the HF models themselves are exercised by every checkpoint test):
block-scaled FP8 against the library's own quantizer, the expert split and fuse as inverses, which tensors the
FP8 form quantizes, the refused forms, the MTP head's tensors, and the raw safetensors helpers."""

from __future__ import annotations

import json
import struct
import types

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qwen35_lib import safetensors_io, testing
from qwen35_lib.weights import FP8_MAX, dequantize_fp8_np, quantize_fp8


def test_fp8_blocks_by_hand_and_against_the_librarys_quantizer():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((20, 36)).astype(np.float32)  # blocks of 16: 2 x 3, the last ones partial
    w[16:, 32:] = 0  # an all-zero block: scale 1
    q, scale = testing.quantize_fp8_blocks(w, 16)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == w.shape and scale.shape == (2, 3)
    np.testing.assert_allclose(scale[0, 0], np.abs(w[:16, :16]).max() / FP8_MAX, rtol=1e-7)
    assert scale[1, 2] == 1.0 and not q[16:, 32:].astype(np.float32).any()
    assert np.abs(q[:16, :16].astype(np.float32)).max() == FP8_MAX  # each block reaches the top of e4m3
    back = testing.dequantize_fp8_blocks(q, scale, 16)
    np.testing.assert_allclose(back, w, rtol=2 ** -4, atol=1e-7)  # 3 mantissa bits: half an ulp is 2^-4
    lib = quantize_fp8(jnp.asarray(w), 16, (0, 1))
    np.testing.assert_allclose(np.asarray(lib.scale), scale, rtol=3e-7)  # XLA's division may round the last bit
    np.testing.assert_array_equal(np.asarray(lib.value).astype(np.float32), q.astype(np.float32))
    np.testing.assert_array_equal(dequantize_fp8_np(q, scale, 16), back)


def test_split_and_fuse_experts_are_inverses():
    rng = np.random.default_rng(1)
    E, F, D = 3, 4, 5
    fused = {"model.layers.0.mlp.experts.gate_up_proj": rng.standard_normal((E, 2 * F, D)),
             "model.layers.0.mlp.experts.down_proj": rng.standard_normal((E, D, F)),
             "model.norm.weight": rng.standard_normal(D)}
    split = testing.split_experts(fused)
    assert len(split) == 3 * E + 1
    np.testing.assert_array_equal(split["model.layers.0.mlp.experts.1.up_proj.weight"],
                                  fused["model.layers.0.mlp.experts.gate_up_proj"][1, F:])
    np.testing.assert_array_equal(split["model.layers.0.mlp.experts.2.down_proj.weight"],
                                  fused["model.layers.0.mlp.experts.down_proj"][2])
    back = testing.fuse_experts(split)
    assert back.keys() == fused.keys()
    for k in fused:
        np.testing.assert_array_equal(back[k], fused[k])


def test_the_fp8_form_quantizes_linear_weights_but_embedding_head_and_router():
    m = np.zeros((4, 4))
    assert testing.is_quantized("model.layers.0.mlp.experts.0.up_proj.weight", m)
    assert testing.is_quantized("model.layers.3.self_attn.q_proj.weight", m)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"):
        assert not testing.is_quantized(name, m)
    assert not testing.is_quantized("model.layers.0.input_layernorm.weight", np.zeros(4))  # 1-D
    assert not testing.is_quantized("model.layers.0.linear_attn.A_log", m)  # not a .weight


def test_unknown_forms_and_a_vl_qwen3_next_are_refused():
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen3_next"))
    with pytest.raises(ValueError, match="unknown checkpoint form 'gguf'; forms: per_expert, fused"):
        testing.check_form(model, "gguf")
    with pytest.raises(ValueError, match="Qwen3-Next has no vision-language checkpoint"):
        testing.check_form(model, "language_model")
    testing.check_form(model, "fp8")  # fine


def test_mtp_head_tensors_have_the_published_names_and_the_configs_shapes():
    """vLLM's Qwen3.5 MTP names: pre-fc norms, fc [D, 2D], a full-attention decoder layer named as a main one (fused
    experts), the final norm; shapes from the (text) config; seeded; cast to the asked dtype."""
    text = types.SimpleNamespace(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 num_experts=3, moe_intermediate_size=6, shared_expert_intermediate_size=5)
    head = testing.mtp_tensors(types.SimpleNamespace(text_config=text))  # a VL config: its text_config
    L, A, M = "mtp.layers.0.", "mtp.layers.0.self_attn.", "mtp.layers.0.mlp."
    assert {n: w.shape for n, w in head.items()} == {
        "mtp.pre_fc_norm_embedding.weight": (16,), "mtp.pre_fc_norm_hidden.weight": (16,), "mtp.fc.weight": (16, 32),
        L + "input_layernorm.weight": (16,), L + "post_attention_layernorm.weight": (16,),
        A + "q_proj.weight": (64, 16), A + "k_proj.weight": (16, 16), A + "v_proj.weight": (16, 16),
        A + "o_proj.weight": (16, 32), A + "q_norm.weight": (8,), A + "k_norm.weight": (8,),
        M + "gate.weight": (3, 16), M + "experts.gate_up_proj": (3, 12, 16), M + "experts.down_proj": (3, 16, 6),
        M + "shared_expert.gate_proj.weight": (5, 16), M + "shared_expert.up_proj.weight": (5, 16),
        M + "shared_expert.down_proj.weight": (16, 5), M + "shared_expert_gate.weight": (1, 16),
        "mtp.norm.weight": (16,)}
    assert all(w.dtype == np.float32 for w in head.values())
    again = testing.mtp_tensors(text, ml_dtypes.bfloat16)
    for name, w in head.items():
        assert again[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(again[name].astype(np.float32), w.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.abs(head[M + "gate.weight"]).std() > 5 * np.abs(head["mtp.fc.weight"]).std()  # routing far from ties
    split = testing.split_experts(head)  # the per-expert form, as the Qwen3.5 checkpoints store the head's experts
    assert M + "experts.2.down_proj.weight" in split and M + "experts.gate_up_proj" not in split


def test_raw_safetensors_round_trip_and_header_edits(tmp_path):
    path = tmp_path / "a.safetensors"
    safetensors_io.save_file({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, path, metadata={"format": "pt"})
    header, data = testing.read_raw_safetensors(path)
    assert header["x"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert np.frombuffer(data, np.float32).tolist() == [0, 1, 2, 3, 4, 5]
    testing.edit_header(path, lambda h: h["x"].update(shape=[3, 2]))
    np.testing.assert_array_equal(safetensors_io.load_file(path)["x"], np.arange(6).reshape(3, 2))
    testing.edit_header(path, lambda h: {"y": h["x"]})  # a returned dict replaces the header
    assert set(safetensors_io.load_file(path)) == {"y"}
    testing.write_raw_safetensors(path, b"{}", b"", length=99)  # a lying length, written as asked
    raw = path.read_bytes()
    assert struct.unpack("<Q", raw[:8]) == (99,) and raw[8:] == b"{}"
    testing.write_raw_safetensors(path, {"__metadata__": {}})
    assert json.loads(path.read_bytes()[8:]) == {"__metadata__": {}}
