"""HF checkpoint loading: every on-disk form of both model types, FP8 (dequantized and kept), dtypes, errors.

The expected weights come from the HF model's own modules (`expected_weights`), not from the loader's code:
each projection is applied to the identity matrix (a Linear maps basis vectors to the rows of W.T, our
[in, out] layout) and split the way HF's forward splits it (`torch.chunk`, `fix_query_key_value_ordering`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import json
import logging
import os
import re
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import safetensors_io, testing  # noqa: E402
from qwen35_lib.checkpoint import CheckpointError, load_hf_checkpoint, path_infos  # noqa: E402
from qwen35_lib.config import ConfigError, from_hf_config, get_config  # noqa: E402
from qwen35_lib.safetensors_io import SafeTensorsError  # noqa: E402
from qwen35_lib.weights import declare, dequantize_fp8  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning")]
MODEL_TYPES = ("qwen3_5_moe", "qwen3_next")
FORMS = [(mt, form) for mt in MODEL_TYPES for form in testing.FORMS
         if not (mt == "qwen3_next" and form == "language_model")]


class Checkpoints:
    """Models and checkpoint directories, each built once per module on first use."""

    def __init__(self, root):
        self.root = root
        self.models: dict = {}
        self.paths: dict = {}

    def model(self, model_type: str, dtype: str = "float32", **overrides):
        key = (model_type, dtype, tuple(sorted(overrides.items())))
        if key not in self.models:
            self.models[key] = testing.make_hf_model(model_type, dtype=dtype, **overrides)
        return self.models[key]

    def __call__(self, model_type: str, form: str, dtype: str = "float32", fp8_block: int = testing.FP8_BLOCK,
                 **overrides):
        key = (model_type, form, dtype, fp8_block, tuple(sorted(overrides.items())))
        if key not in self.paths:
            name = "_".join(map(str, key[:4])) + "".join(f"_{k}{v}" for k, v in key[4])
            model = self.model(model_type, dtype, **overrides)
            self.paths[key] = testing.save_hf_checkpoint(model, self.root / name, form, fp8_block=fp8_block)
        return self.paths[key]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("ckpts"))


def expected_weights(model) -> dict[tuple[str, ...], np.ndarray]:
    """Our weight tree (float32, by path) computed from the HF model's modules."""
    hc = model.config
    c = from_hf_config({**hc.to_dict(), "dtype": "float32"})
    out = {p: np.zeros(info.shape, np.float32) for p, info in path_infos(declare(c))}
    D, E, F, Fs = c.hidden_size, c.num_experts, c.moe_ffn, c.shared_ffn
    nk, nv, dk, dv, K = c.gdn_num_k_heads, c.gdn_num_v_heads, c.gdn_k_head_dim, c.gdn_v_head_dim, c.gdn_conv_kernel
    Hq, Hkv, hd, kd, vd = c.num_q_heads, c.num_kv_heads, c.head_dim, c.gdn_key_dim, c.gdn_value_dim
    model = copy.deepcopy(model).float()  # .float() works in place

    def np_(t):
        return t.detach().float().numpy()

    def eye(n):  # a batch of one "sequence" of the n basis vectors
        return torch.eye(n)[None]

    with torch.no_grad():
        out["embed",] = np_(model.model.embed_tokens.weight)
        out["lm_head",] = np_(model.lm_head(eye(D))[0])
        out["final_norm",] = np_(model.model.norm.weight)
        for i, layer in enumerate(model.model.layers):
            g, p = divmod(i, len(c.layer_pattern))
            kind = c.layer_types[i]
            j = c.layer_pattern[:p].count(kind)
            out["layers", "input_norm"][g, p] = np_(layer.input_layernorm.weight)
            out["layers", "post_norm"][g, p] = np_(layer.post_attention_layernorm.weight)
            mlp, moe = layer.mlp, ("layers", "moe")
            out[(*moe, "router")][g, p] = np_(mlp.gate.weight).T
            for e in range(E):
                gate, up = torch.nn.functional.linear(eye(D)[0], mlp.experts.gate_up_proj[e]).chunk(2, dim=-1)
                out[(*moe, "w_gate_up")][g, p, e, :, 0] = np_(gate)
                out[(*moe, "w_gate_up")][g, p, e, :, 1] = np_(up)
                out[(*moe, "w_down")][g, p, e] = np_(torch.nn.functional.linear(eye(F)[0], mlp.experts.down_proj[e]))
            out[(*moe, "shared_gate_up")][g, p, :, 0] = np_(mlp.shared_expert.gate_proj(eye(D))[0])
            out[(*moe, "shared_gate_up")][g, p, :, 1] = np_(mlp.shared_expert.up_proj(eye(D))[0])
            out[(*moe, "shared_down")][g, p] = np_(mlp.shared_expert.down_proj(eye(Fs))[0])
            out[(*moe, "shared_gate")][g, p] = np_(mlp.shared_expert_gate.weight[0])
            if kind == "linear_attention":
                la, gdn = layer.linear_attn, ("layers", "gdn")
                if c.model_type == "qwen3_next":
                    q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(eye(D)), la.in_proj_ba(eye(D)))
                    q, k, v, z, b, a = (t[0] for t in (q, k, v, z, b, a))
                else:
                    q, k, v = torch.split(la.in_proj_qkv(eye(D))[0], [kd, kd, vd], dim=-1)
                    q, k, v = q.reshape(D, nk, dk), k.reshape(D, nk, dk), v.reshape(D, nv, dv)
                    z = la.in_proj_z(eye(D))[0].reshape(D, nv, dv)
                    b, a = la.in_proj_b(eye(D))[0], la.in_proj_a(eye(D))[0]
                for name, t in dict(w_q=q, w_k=k, w_v=v, w_z=z, w_b=b, w_a=a).items():
                    out[(*gdn, name)][g, j] = np_(t)
                taps = np_(la.conv1d.weight)[:, 0, :].T  # [K, conv_dim], channels [q | k | v]
                out[(*gdn, "conv_q")][g, j] = taps[:, :kd].reshape(K, nk, dk)
                out[(*gdn, "conv_k")][g, j] = taps[:, kd:2 * kd].reshape(K, nk, dk)
                out[(*gdn, "conv_v")][g, j] = taps[:, 2 * kd:].reshape(K, nv, dv)
                out[(*gdn, "A_log")][g, j] = np_(la.A_log)
                out[(*gdn, "dt_bias")][g, j] = np_(la.dt_bias)
                out[(*gdn, "norm")][g, j] = np_(la.norm.weight)
                out[(*gdn, "w_out")][g, j] = np_(la.out_proj(eye(vd))[0]).reshape(nv, dv, D)
            else:
                sa, attn = layer.self_attn, ("layers", "attn")
                q, gate = torch.chunk(sa.q_proj(eye(D))[0].view(D, Hq, 2 * hd), 2, dim=-1)
                out[(*attn, "w_q")][g, j], out[(*attn, "w_gate")][g, j] = np_(q), np_(gate)
                out[(*attn, "w_k")][g, j] = np_(sa.k_proj(eye(D))[0]).reshape(D, Hkv, hd)
                out[(*attn, "w_v")][g, j] = np_(sa.v_proj(eye(D))[0]).reshape(D, Hkv, hd)
                out[(*attn, "w_o")][g, j] = np_(sa.o_proj(eye(Hq * hd))[0]).reshape(Hq, hd, D)
                out[(*attn, "q_norm")][g, j] = np_(sa.q_norm.weight)
                out[(*attn, "k_norm")][g, j] = np_(sa.k_norm.weight)
    return out


def assert_weights_equal(config, weights, expected: dict, dtype=None) -> None:
    """Every leaf has its declared shape and dtype, and equals `expected` (cast to the leaf's dtype) exactly."""
    declared = dict(path_infos(declare(config)))
    got = dict(path_infos(weights))
    assert got.keys() == declared.keys() == expected.keys()
    for path, leaf in got.items():
        assert (leaf.shape, leaf.dtype) == (declared[path].shape, declared[path].dtype), path
        want = expected[path].astype(leaf.dtype).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), want, err_msg=str(path))


# ---------------------------------------------------------------------------------------------------------------
# Forms


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


def _fuse_fp8_experts(src, dst):
    """An FP8 checkpoint with fused experts: `gate_up_proj` + `gate_up_proj_scale_inv` [E, 2 cdiv(F, b), cdiv(D, b)]."""
    shutil.copytree(src, dst)
    t = safetensors_io.load_file(dst / "model.safetensors")
    fused = {}
    for name in sorted(t):
        head, sep, tail = name.partition(".mlp.experts.")
        if sep:
            e, proj, kind = tail.split(".", 2)
            fused.setdefault((head, proj, kind), {})[int(e)] = t.pop(name)
    for (head, proj, kind), per in list(fused.items()):
        if proj == "gate_proj":
            up = fused[head, "up_proj", kind]
            stacked = np.stack([np.concatenate([per[e], up[e]]) for e in sorted(per)])
            t[f"{head}.mlp.experts.gate_up_proj" + ("_scale_inv" if kind == "weight_scale_inv" else "")] = stacked
        elif proj == "down_proj":
            t[f"{head}.mlp.experts.down_proj" + ("_scale_inv" if kind == "weight_scale_inv" else "")] = np.stack(
                [per[e] for e in sorted(per)])
    safetensors_io.save_file(t, dst / "model.safetensors")
    return dst


def test_fp8_fused_experts(ckpts, tmp_path):
    """Fused FP8 experts (`gate_up_proj_scale_inv`) load like per-expert ones, dequantized and kept."""
    per_expert = ckpts("qwen3_5_moe", "fp8")
    fused = _fuse_fp8_experts(per_expert, tmp_path / "fused_fp8")
    for fp8 in ("dequantize", "keep"):
        _, a = load_hf_checkpoint(per_expert, fp8=fp8)
        _, b = load_hf_checkpoint(fused, fp8=fp8)
        for (pa, la), (pb, lb) in zip(path_infos(a), path_infos(b), strict=True):
            assert pa == pb and la.dtype == lb.dtype
            np.testing.assert_array_equal(np.asarray(la, np.float32), np.asarray(lb, np.float32), err_msg=str(pa))


# ---------------------------------------------------------------------------------------------------------------
# Dtypes, tied embeddings, read-once, place


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


# ---------------------------------------------------------------------------------------------------------------
# Errors name the problem and the fix


def _edited(src, dst, drop=(), add=None, config=None):
    """A copy of checkpoint `src` with tensors dropped / added / replaced and config.json fields changed."""
    shutil.copytree(src, dst)
    tensors = safetensors_io.load_file(dst / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    safetensors_io.save_file(tensors, dst / "model.safetensors")
    if config:
        hf = json.loads((dst / "config.json").read_text())
        hf.update(config)
        (dst / "config.json").write_text(json.dumps(hf))
    return dst


def test_missing_tensors_are_listed(ckpts, tmp_path):
    src = ckpts("qwen3_5_moe", "per_expert")
    path = _edited(src, tmp_path / "one", drop=["model.layers.2.linear_attn.in_proj_z.weight"])
    with pytest.raises(ValueError, match=r"1 tensors that config.json implies are missing: "
                                         r"model\.layers\.2\.linear_attn\.in_proj_z\.weight\. Check"):
        load_hf_checkpoint(path)
    experts = [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")]
    path = _edited(src, tmp_path / "many", drop=experts)
    with pytest.raises(ValueError, match=r"24 tensors .* missing: .*experts\.4\.up_proj\.weight \.\.\. and 14 more"):
        load_hf_checkpoint(path)
    path = _edited(ckpts("qwen3_next", "fp8"), tmp_path / "scale",
                   drop=["model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv"])
    with pytest.raises(ValueError, match=r"missing: model\.layers\.0\.linear_attn\.in_proj_qkvz\.weight_scale_inv"):
        load_hf_checkpoint(path)


def test_shape_mismatch(ckpts, tmp_path):
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    path = _edited(ckpts("qwen3_5_moe", "per_expert"), tmp_path / "t", add={name: np.zeros((96, 60), np.float32)})
    with pytest.raises(ValueError, match=rf"{name}: config.json implies \(96, 64\), the file has \(96, 60\)"):
        load_hf_checkpoint(path)
    path = _edited(ckpts("qwen3_next", "fused"), tmp_path / "c", config={"moe_intermediate_size": 40})
    with pytest.raises(ValueError, match=r"disagree .*gate_up_proj: config.json implies \(8, 80, 64\), the file has"):
        load_hf_checkpoint(path)


def test_leftover_tensors(ckpts, tmp_path):
    path = _edited(ckpts("qwen3_5_moe", "per_expert"), tmp_path / "x",
                   add={"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"1 tensors are neither .*: model\.layers\.0\.mlp\.extra\.weight"):
        load_hf_checkpoint(path)
    path = _edited(ckpts("qwen3_5_moe", "per_expert"), tmp_path / "nl", add={"a\nb" * 100: np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"1 tensors are neither .*: 'a\\nba\\nb.*\.\.\.\. Is config") as e:
        load_hf_checkpoint(path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 600  # a header's name is shown escaped and cut


def test_bad_directories(ckpts, tmp_path):
    src = ckpts("qwen3_5_moe", "per_expert")
    path = _edited(src, tmp_path / "llama", config={"model_type": "llama"})
    with pytest.raises(ValueError, match="unknown model_type 'llama'"):
        load_hf_checkpoint(path)
    (tmp_path / "empty").mkdir()
    shutil.copy(src / "config.json", tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files .* safetensors only"):
        load_hf_checkpoint(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    sharded = tmp_path / "sharded"
    shutil.copytree(ckpts("qwen3_5_moe", "sharded"), sharded)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="names 1 files missing"):
        load_hf_checkpoint(sharded)
    with pytest.raises(ValueError, match="no FP8 weights"):
        load_hf_checkpoint(src, expert_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="fp8='bogus'"):
        load_hf_checkpoint(src, fp8="bogus")


# ---------------------------------------------------------------------------------------------------------------
# Broken checkpoints that used to load (issue 15): each gets a one-line error naming the file and the fix


def _one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_overlapping_offsets_are_refused(ckpts, tmp_path):
    """The embedding's entry pointing at lm_head's bytes (same shape) used to load it as a copy of lm_head."""
    path = shutil.copytree(ckpts("qwen3_5_moe", "fused"), tmp_path / "alias")

    def alias(header):
        header["model.embed_tokens.weight"]["data_offsets"] = header["lm_head.weight"]["data_offsets"]

    testing.edit_header(path / "model.safetensors", alias)
    with pytest.raises(SafeTensorsError, match=r"model\.safetensors: tensor '(lm_head|model\.embed_tokens)\.weight' "
                                               r"starts at byte \d+, where \d+ was next: it overlaps") as e:
        load_hf_checkpoint(path)
    _one_line(e)


@pytest.mark.parametrize("name, stored", [("lm_head.weight", np.int32), ("model.norm.weight", np.uint8),
                                          ("model.layers.3.self_attn.k_norm.weight", np.bool_)])
def test_integer_tensors_for_float_weights_are_refused(ckpts, tmp_path, name, stored):
    """An I32 lm_head used to be cast to zeros (every token 0); a stored kind other than the weight's is refused."""
    src = ckpts("qwen3_5_moe", "per_expert")
    shape = safetensors_io.SafeTensorsFile(src / "model.safetensors").tensors[name].shape
    path = _edited(src, tmp_path / "int", add={name: np.ones(shape, stored)})
    st_name = safetensors_io.NAMES[np.dtype(stored)]
    with pytest.raises(CheckpointError, match=rf"1 tensors hold another kind of number than their weight: "
                                              rf"{re.escape(name)} is stored as {st_name} \((int|bool)s\), but its "
                                              rf"weight is float32\. A cast would make them garbage") as e:
        load_hf_checkpoint(path)
    _one_line(e)


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


NONFINITE = [("model.layers.2.linear_attn.in_proj_z.weight", (3, 5), np.nan),
             ("model.layers.1.mlp.experts.6.down_proj.weight", (0, 7), np.inf),
             ("lm_head.weight", (255, 0), -np.inf)]


@pytest.mark.parametrize("name, index, value", NONFINITE)
def test_nonfinite_weights_are_refused(ckpts, tmp_path, name, index, value):
    """NaN / Inf weights used to give tokens [0, 0, 0]; they are refused, naming the tensor; check_weights=False
    loads them as they are."""
    src = ckpts("qwen3_5_moe", "per_expert")
    w = safetensors_io.load_file(src / "model.safetensors")[name]
    w[index] = value
    path = _edited(src, tmp_path / "nan", add={name: w})
    with pytest.raises(CheckpointError, match=rf"nan: 1 tensors hold NaN or Inf values: {re.escape(name)} \(leaves "
                                              r".*check_weights=False \(CLI: --no-check-weights\)") as e:
        load_hf_checkpoint(path)
    _one_line(e)
    _, weights = load_hf_checkpoint(path, check_weights=False)
    assert sum(int((~np.isfinite(np.asarray(leaf, np.float32))).sum()) for _, leaf in path_infos(weights)) >= 1


def test_nonfinite_fp8_scale_and_sharded_leaves(ckpts, tmp_path):
    """A NaN FP8 scale is named (its weight dequantizes to NaN); a NaN expert is found on sharded leaves too."""
    src = ckpts("qwen3_next", "fp8")
    scale = "model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv"
    s = safetensors_io.load_file(src / "model.safetensors")[scale]
    s[1, 2] = np.nan
    path = _edited(src, tmp_path / "scale", add={scale: s})
    with pytest.raises(CheckpointError, match=rf"1 tensors hold NaN or Inf values: {re.escape(scale)} \(leaves "):
        load_hf_checkpoint(path)
    from qwen35_lib.plan import make_mesh

    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    src = ckpts("qwen3_5_moe", "per_expert")
    w = safetensors_io.load_file(src / "model.safetensors")[name]
    w[2, 3] = np.nan
    path = _edited(src, tmp_path / "sharded", add={name: w})
    with pytest.raises(CheckpointError, match=rf"1 tensors hold NaN or Inf values: {re.escape(name)} \(leaves "
                                              r"layers/moe/w_gate_up\)"):
        load_hf_checkpoint(path, mesh=make_mesh(), layout="dp8_ep8")


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


def _sharded_copy(ckpts, dst):
    return shutil.copytree(ckpts("qwen3_5_moe", "sharded"), dst)


def _set_entry(path, tensor, file):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][tensor] = file
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABS", "sub/model.safetensors", "..", "", ".",
                                   "a\\b.safetensors"])
def test_index_entries_are_plain_file_names(ckpts, tmp_path, entry):
    """An index naming `../x` or an absolute path used to open that file; only plain names in the folder pass."""
    path = _sharded_copy(ckpts, tmp_path / "ckpt")
    shutil.copy(path / "model-00001-of-00003.safetensors", tmp_path / "outside.safetensors")  # a real file there
    (path / "sub").mkdir()
    shutil.copy(path / "model-00001-of-00003.safetensors", path / "sub" / "model.safetensors")
    entry = str(tmp_path / "outside.safetensors") if entry == "ABS" else entry
    _set_entry(path, "model.norm.weight", entry)
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map\['model\.norm\.weight'\] is "
                                              r".*, not a plain file name in the checkpoint folder") as e:
        load_hf_checkpoint(path)
    _one_line(e)


@pytest.mark.timeout(60)
def test_special_files_are_refused_without_hanging(ckpts, tmp_path):
    """An index entry naming a FIFO used to hang on open; a FIFO or directory among `*.safetensors` too."""
    path = _sharded_copy(ckpts, tmp_path / "fifo")
    (path / "model-00002-of-00003.safetensors").unlink()
    os.mkfifo(path / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors: a FIFO; a checkpoint's weights are "
                                              r"regular files"):
        load_hf_checkpoint(path)
    path = shutil.copytree(ckpts("qwen3_5_moe", "fused"), tmp_path / "glob")
    (path / "extra.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"extra\.safetensors: a directory"):
        load_hf_checkpoint(path)


def test_symlinks_into_a_blob_store_load(ckpts, tmp_path):
    """The Hugging Face cache layout: snapshots/<rev>/<file> are relative symlinks to ../../blobs/<hash>."""
    src = ckpts("qwen3_5_moe", "sharded")
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    config, weights = load_hf_checkpoint(snapshot)
    _, want = load_hf_checkpoint(src)
    for (p, a), (_, b) in zip(path_infos(weights), path_infos(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))


@pytest.mark.parametrize("text, error, match", [
    ('{"metadata": {}}', CheckpointError, "no weight_map object"),
    ('[1, 2]', CheckpointError, "no weight_map object"),
    ('{"weight_map": ["model-00001-of-00003.safetensors"]}', CheckpointError, "no weight_map object"),
    ('{"weight_map": {"model.norm.weight": 3}}', CheckpointError, r"weight_map\['model\.norm\.weight'\] is not a file"),
    ('{"weight_map": {\n  "a": "b",\n  oops}', ConfigError, r"invalid JSON at line 3, column 3: Expecting")])
def test_broken_index(ckpts, tmp_path, text, error, match):
    path = _sharded_copy(ckpts, tmp_path / "index")
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(error, match=rf"{re.escape(str(path / 'model.safetensors.index.json'))}: {match}") as e:
        load_hf_checkpoint(path)
    _one_line(e)


def test_a_file_that_is_not_safetensors_is_not_printed(ckpts, tmp_path):
    """Today's error printed the first 8 bytes (as the header length); now nothing of the file is shown."""
    path = _sharded_copy(ckpts, tmp_path / "text")
    secret = b"password=hunter2 and then some more text"
    (path / "model-00003-of-00003.safetensors").write_bytes(secret)
    with pytest.raises(SafeTensorsError, match=r"model-00003-of-00003\.safetensors: not a safetensors file") as e:
        load_hf_checkpoint(path)
    message = _one_line(e)
    assert "hunter2" not in message and str(int.from_bytes(secret[:8], "little")) not in message


@pytest.mark.parametrize("text, match", [
    ('{"model_type": "qwen3_next",\n "vocab_size": 256,,\n}', r"invalid JSON at line 2, column 20: Expecting"),
    ('[{"model_type": "qwen3_next"}]', r"holds a list, not a JSON object of model fields"),
])
def test_broken_config_json_names_the_file(ckpts, tmp_path, text, match):
    path = shutil.copytree(ckpts("qwen3_next", "fused"), tmp_path / "cfg")
    (path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path / 'config.json'))}: {match}") as e:
        load_hf_checkpoint(path)
    _one_line(e)


def test_config_json_fields_are_typed_at_load(ckpts, tmp_path):
    path = _edited(ckpts("qwen3_next", "fused"), tmp_path / "t", config={"num_key_value_heads": 0})
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path / 'config.json'))}: num_key_value_heads is 0; it"):
        load_hf_checkpoint(path)
    path = _edited(ckpts("qwen3_next", "fused"), tmp_path / "tie", config={"tie_word_embeddings": "no"})
    with pytest.raises(ConfigError, match="tie_word_embeddings is 'no'; it must be true or false"):
        load_hf_checkpoint(path)


# ---------------------------------------------------------------------------------------------------------------
# safetensors_io


def test_safetensors_round_trip_and_interop(tmp_path):
    """Our writer and reader agree with each other and with the `safetensors` package, for every dtype."""
    import safetensors.numpy
    import safetensors.torch

    rng = np.random.default_rng(0)
    arrays = {dt: rng.standard_normal((3, 5)).astype(dt) for dt in
              ("float64", "float32", "float16", ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)}
    arrays.update({dt: rng.integers(-100, 100, (4,)).astype(dt) for dt in ("int64", "int32", "int16", "int8")})
    tensors = {f"t.{np.dtype(dt).name}": a for dt, a in arrays.items()}
    tensors.update({"u8": np.arange(7, dtype=np.uint8), "bool": np.array([True, False]), "empty": np.zeros((0, 3))})
    safetensors_io.save_file(tensors, tmp_path / "ours.safetensors", metadata={"format": "np"})
    with safetensors_io.SafeTensorsFile(tmp_path / "ours.safetensors") as f:
        assert f.metadata == {"format": "np"}
        for name, a in tensors.items():
            got = f.get(name)
            assert got.dtype == a.dtype and got.shape == a.shape and not got.flags.writeable
            np.testing.assert_array_equal(got.view(np.uint8), a.view(np.uint8), err_msg=name)
    with safetensors.safe_open(tmp_path / "ours.safetensors", "pt") as f:  # the reference reader reads our file
        for name, a in tensors.items():
            t = f.get_tensor(name)
            if a.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):  # numpy-less dtypes: compare the bits
                t, a = t.view(torch.uint8), a.view(np.uint8)
            np.testing.assert_array_equal(t.numpy(), a, err_msg=name)
    plain = {n: a for n, a in tensors.items() if "bfloat16" not in n and "float8" not in n}
    torch_tensors = {"bf16": torch.randn(4, 3).bfloat16(), "f8": torch.randn(5).to(torch.float8_e4m3fn)}
    safetensors.torch.save_file(torch_tensors, tmp_path / "torch.safetensors")
    safetensors.numpy.save_file(plain, tmp_path / "np.safetensors")
    ours = safetensors_io.load_file(tmp_path / "torch.safetensors")
    for name, t in torch_tensors.items():
        np.testing.assert_array_equal(ours[name].view(np.uint8), t.view(torch.uint8).numpy(), err_msg=name)
    for name, a in safetensors_io.load_file(tmp_path / "np.safetensors").items():
        np.testing.assert_array_equal(a, plain[name], err_msg=name)


def test_safetensors_rejects_bad_files(tmp_path):
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_io.SafeTensorsFile(tmp_path / "short")
    safetensors_io.save_file({"x": np.zeros(10, np.float32)}, tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(safetensors_io.SafeTensorsError, match=r"cover 40 data bytes, the file holds 32: truncated"):
        safetensors_io.SafeTensorsFile(tmp_path / "cut.safetensors")


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
