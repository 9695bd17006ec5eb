"""The checkpoint tests' models and checkpoint folders (`Checkpoints`, the package-wide `ckpts` fixture in
conftest.py), the weights HF's own modules imply (`expected_weights`), and edited copies of checkpoints."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import safetensors_io, testing  # noqa: E402
from qwen35_lib.checkpoint import path_infos  # noqa: E402
from qwen35_lib.config import from_hf_config  # noqa: E402
from qwen35_lib.weights import declare  # noqa: E402

MODEL_TYPES = ("qwen3_5_moe", "qwen3_next")
FORMS = [(mt, form) for mt in MODEL_TYPES for form in testing.FORMS
         if not (mt == "qwen3_next" and form == "language_model")]


class Checkpoints:
    """Models and checkpoint directories, each built once on first use (the `ckpts` fixture: once a package)."""

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


def fuse_fp8_experts(src, dst):
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


def edited(src, dst, drop=(), add=None, config=None):
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


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    return message


NONFINITE = [("model.layers.2.linear_attn.in_proj_z.weight", (3, 5), np.nan),
             ("model.layers.1.mlp.experts.6.down_proj.weight", (0, 7), np.inf),
             ("lm_head.weight", (255, 0), -np.inf)]


def sharded_copy(ckpts, dst):
    return shutil.copytree(ckpts("qwen3_5_moe", "sharded"), dst)


def set_entry(path, tensor, file):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][tensor] = file
    (path / "model.safetensors.index.json").write_text(json.dumps(index))

