"""The MTP head: its forward against a NumPy statement of the published definition (vLLM's Qwen3.5 / Qwen3-Next MTP
modules), written here from the HF tensors in float64 (float32 and FP8-kept experts; bf16 against float32); its
loading in every form the main loader reads (fused, per expert, sharded files, the VL layout, FP8 dequantized and
kept, sliced onto a mesh, where it runs under dp8_ep8 as on one device), each a round trip of the tensors
`qwen35_lib.testing` writes; the main loader still skipping it.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import safetensors_io, testing  # noqa: E402
from qwen35_lib.checkpoint import CheckpointError, load_hf_checkpoint, load_mtp, path_infos  # noqa: E402
from qwen35_lib.model.mtp import declare_mtp, mtp_forward  # noqa: E402
from qwen35_lib.weights import BlockFP8, dequantize_fp8  # noqa: E402
from tests.checkpoint.support import edited  # noqa: E402  (a copy of a checkpoint with tensors dropped / added)

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*skipped .* vision:UserWarning")]
MODEL_TYPES = ("qwen3_5_moe", "qwen3_next")


class Checkpoints:
    """One seeded tiny model per type and its checkpoints with an MTP head, each written once per module."""

    def __init__(self, root):
        self.root, self.models, self.paths = root, {}, {}

    def model(self, model_type: str):
        if model_type not in self.models:
            self.models[model_type] = testing.make_hf_model(model_type)
        return self.models[model_type]

    def __call__(self, model_type: str, form: str, mtp: bool = True):
        key = (model_type, form, mtp)
        if key not in self.paths:
            self.paths[key] = testing.save_hf_checkpoint(self.model(model_type), self.root / "_".join(map(str, key)),
                                                         form, mtp=mtp)
        return self.paths[key]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("mtp"))


# ---------------------------------------------------------------------------------------------------------------
# The published definition, in NumPy (float64), on the HF tensors


def np_rms(x, w, eps):
    """Zero-centred RMSNorm (Qwen3.5 / Qwen3-Next's, the MTP norms included): x / rms(x) * (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return np.exp(x) / np.exp(x).sum(axis=-1, keepdims=True)


def np_mtp(t: dict, hc, hidden: np.ndarray, next_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One row: hidden [T, D] (the main model's normed last hidden states), next_ids [T] -> (out [T, D], logits
    [T, V]), as vLLM's Qwen3_5MultiTokenPredictor + Qwen3_5MTP.compute_logits compute it, positions 0..T-1."""
    t = {n: np.asarray(w, np.float64) for n, w in t.items()}
    T, D = hidden.shape
    Hq, Hkv, hd, eps = hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim, hc.rms_norm_eps
    E, k, F = hc.num_experts, hc.num_experts_per_tok, hc.moe_intermediate_size
    rd = int(hd * hc.rope_parameters["partial_rotary_factor"])
    theta = hc.rope_parameters["rope_theta"]
    L, A, M = "mtp.layers.0.", "mtp.layers.0.self_attn.", "mtp.layers.0.mlp."
    # fc on cat([normed embedding, normed hidden])
    e = np_rms(t["model.embed_tokens.weight"][next_ids], t["mtp.pre_fc_norm_embedding.weight"], eps)
    h = np_rms(hidden.astype(np.float64), t["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ t["mtp.fc.weight"].T  # [T, D]
    # gated GQA attention, causal, partial NeoX RoPE on the first rd dims of each head
    a = np_rms(x, t[L + "input_layernorm.weight"], eps)
    qg = (a @ t[A + "q_proj.weight"].T).reshape(T, Hq, 2 * hd)  # per head [query | gate]
    q, gate = np_rms(qg[..., :hd], t[A + "q_norm.weight"], eps), qg[..., hd:]
    kk = np_rms((a @ t[A + "k_proj.weight"].T).reshape(T, Hkv, hd), t[A + "k_norm.weight"], eps)
    v = (a @ t[A + "v_proj.weight"].T).reshape(T, Hkv, hd)
    ang = np.arange(T)[:, None] * theta ** (-np.arange(0, rd, 2) / rd)  # [T, rd/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]

    def rope(u):
        r = u[..., :rd]
        half = np.concatenate([-r[..., rd // 2:], r[..., : rd // 2]], axis=-1)
        return np.concatenate([r * cos + half * sin, u[..., rd:]], axis=-1)

    q, kk = rope(q), rope(kk)
    kk, v = np.repeat(kk, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)  # query head j reads kv head j // r
    s = np.einsum("thd,shd->hts", q, kk) / np.sqrt(hd) + np.where(np.tri(T, dtype=bool), 0.0, -np.inf)
    o = np.einsum("hts,shd->thd", np_softmax(s), v).reshape(T, Hq * hd) * np_sigmoid(gate.reshape(T, Hq * hd))
    x = x + o @ t[A + "o_proj.weight"].T
    # MoE: softmax router, top-k renormalised, SwiGLU experts (gate_up rows [gate | up]); sigmoid-gated shared expert
    m = np_rms(x, t[L + "post_attention_layernorm.weight"], eps)
    probs = np_softmax(m @ t[M + "gate.weight"].T)  # [T, E]
    routed = np.zeros_like(m)
    for i in range(T):
        top = np.argsort(-probs[i])[:k]
        weights = probs[i, top] / probs[i, top].sum()
        for wgt, ex in zip(weights, top):
            gu = t[M + "experts.gate_up_proj"][ex] @ m[i]  # [2F]
            routed[i] += wgt * (t[M + "experts.down_proj"][ex] @ (np_silu(gu[:F]) * gu[F:]))
    assert E == probs.shape[1]
    shared = (np_silu(m @ t[M + "shared_expert.gate_proj.weight"].T) * (m @ t[M + "shared_expert.up_proj.weight"].T)
              ) @ t[M + "shared_expert.down_proj.weight"].T * np_sigmoid(m @ t[M + "shared_expert_gate.weight"].T)
    x = x + routed + shared
    out = np_rms(x, t["mtp.norm.weight"], eps)
    return out, out @ t["lm_head.weight"].T


# ---------------------------------------------------------------------------------------------------------------
# The forward


def _inputs(config, B=2, T=9, seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((B, T, config.hidden_size)).astype(np.float32)
    return hidden, rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_forward_matches_the_published_definition(ckpts, model_type):
    """mtp_forward on the loaded head = the NumPy statement on the checkpoint's tensors, row by row (a padded row's
    real positions as the row alone); fused experts (Qwen3.6's form)."""
    path = ckpts(model_type, "fused")
    config, weights = load_hf_checkpoint(path)
    _, head = load_mtp(path)
    hidden, next_ids = _inputs(config)
    lengths = np.array([9, 5])
    out, logits = mtp_forward(config, weights, head, hidden, next_ids, lengths)
    assert out.shape == hidden.shape and logits.shape == (*next_ids.shape, config.vocab_size)
    assert logits.dtype == jnp.float32 and out.dtype == jnp.float32
    t = testing.checkpoint_tensors(ckpts.model(model_type), "fused", mtp=True)
    for b, n in enumerate(lengths):
        want_out, want = np_mtp(t, ckpts.model(model_type).config, hidden[b, :n], next_ids[b, :n])
        np.testing.assert_allclose(np.asarray(out[b, :n]), want_out, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(logits[b, :n]), want, rtol=1e-4, atol=2e-5)
    assert np.abs(want).max() > 0.1  # not a vanishing output


def test_forward_with_fp8_experts_kept(ckpts):
    """FP8 experts kept as BlockFP8: the head's forward is the definition on the FP8 checkpoint's exact twin."""
    path = ckpts("qwen3_5_moe", "fp8")
    config, weights = load_hf_checkpoint(path, fp8="keep")
    _, head = load_mtp(path, fp8="keep")
    assert isinstance(head["layers"]["moe"]["w_down"], BlockFP8)
    hidden, next_ids = _inputs(config, B=1, T=6, seed=1)
    _, logits = mtp_forward(config, weights, head, hidden, next_ids)
    t = testing.checkpoint_tensors(ckpts.model("qwen3_5_moe"), "fp8_dequantized", mtp=True)
    _, want = np_mtp(testing.fuse_experts(t), ckpts.model("qwen3_5_moe").config, hidden[0], next_ids[0])
    np.testing.assert_allclose(np.asarray(logits[0]), want, rtol=1e-4, atol=2e-5)


def test_bfloat16(ckpts):
    """dtype="bfloat16": every head leaf bf16 (a cast of the float32 checkpoint), the forward in bf16 close to the
    float32 one (bf16's 8 bits of mantissa through two norms, the layer and the LM head)."""
    path = ckpts("qwen3_5_moe", "per_expert")
    config, weights = load_hf_checkpoint(path, dtype="bfloat16")
    _, head = load_mtp(path, dtype="bfloat16")
    assert {leaf.dtype for _, leaf in path_infos(head)} == {jnp.dtype(jnp.bfloat16)}
    hidden, next_ids = _inputs(config, B=1, T=5, seed=2)
    out, logits = mtp_forward(config, weights, head, hidden, next_ids)
    assert out.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    f32 = load_hf_checkpoint(path)
    _, want = mtp_forward(*f32, load_mtp(path)[1], hidden, next_ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=0.03 * np.abs(want).max())


def test_forward_refuses_wrong_inputs(ckpts):
    path = ckpts("qwen3_5_moe", "fused")
    config, weights = load_hf_checkpoint(path)
    _, head = load_mtp(path)
    hidden, next_ids = _inputs(config, B=1, T=4)
    with pytest.raises(ValueError, match=r"hidden must be \[B, T, 64\]"):
        mtp_forward(config, weights, head, hidden[:, :3], next_ids)
    with pytest.raises(ValueError, match="is not the MTP head of .*load_mtp"):
        mtp_forward(config, weights, weights, hidden, next_ids)
    with pytest.raises(ValueError, match=r"\['fc'\] is float32\[2, 64, 64\] but config .* declares float32\[2, 128"):
        mtp_forward(config.replace(hidden_size=128), weights, head, hidden, next_ids)


def test_random_head_has_the_declared_tree_and_runs(tiny):
    """init_mtp_weights: declare_mtp's shapes and dtypes (FP8 experts as BlockFP8 pairs), seeded, its norms at zero
    like the main model's; the head runs on it."""
    from qwen35_lib import get_config
    from qwen35_lib.weights import init_mtp_weights

    cfg, w = tiny
    head = init_mtp_weights(cfg, 3)
    assert [(p, a.shape, a.dtype) for p, a in path_infos(head)] == \
        [(p, i.shape, jnp.dtype(i.dtype)) for p, i in path_infos(declare_mtp(cfg))]
    _assert_trees_equal(head, init_mtp_weights(cfg, 3))
    assert not np.array_equal(head["fc"], init_mtp_weights(cfg, 4)["fc"])
    assert not np.any(head["norm"]) and 0.015 < float(np.std(head["fc"])) < 0.025  # normal(0.02)
    fp8 = get_config("qwen3.5-tiny", expert_dtype="float8_e4m3fn", fp8_block_size=16)
    assert isinstance(init_mtp_weights(fp8, 0)["layers"]["moe"]["w_down"], BlockFP8)
    hidden, next_ids = _inputs(cfg, B=2, T=5)
    out, logits = mtp_forward(cfg, w, head, hidden, next_ids)
    assert out.shape == (2, 5, cfg.hidden_size) and logits.shape == (2, 5, cfg.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _assert_trees_equal(a, b):
    pa, pb = path_infos(a), path_infos(b)
    assert [p for p, _ in pa] == [p for p, _ in pb]
    for (p, x), (_, y) in zip(pa, pb):
        assert x.dtype == y.dtype, p
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=str(p))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_form_loads_the_same_head(ckpts, model_type):
    """The head in its declared shapes, its tensors in place (fc's halves in the published order), identical from
    fused, per-expert, sharded-file and (Qwen3.5) VL checkpoints; the FP8 one is its dequantized twin's, exactly."""
    config, fused = load_mtp(ckpts(model_type, "fused"))
    declared = dict(path_infos(declare_mtp(config)))
    got = dict(path_infos(fused))
    assert got.keys() == declared.keys()
    assert all((a.shape, a.dtype) == (declared[p].shape, declared[p].dtype) for p, a in got.items())
    t = testing.checkpoint_tensors(ckpts.model(model_type), "fused", mtp=True)
    D = config.hidden_size
    np.testing.assert_array_equal(fused["fc"][0], t["mtp.fc.weight"][:, :D].T)  # takes the embedding
    np.testing.assert_array_equal(fused["fc"][1], t["mtp.fc.weight"][:, D:].T)  # takes the hidden state
    np.testing.assert_array_equal(fused["pre_fc_norm_hidden"], t["mtp.pre_fc_norm_hidden.weight"])
    np.testing.assert_array_equal(fused["layers"]["moe"]["w_down"][0, 0],
                                  t["mtp.layers.0.mlp.experts.down_proj"].transpose(0, 2, 1))
    forms = ["per_expert", "sharded"] + (["language_model"] if model_type == "qwen3_5_moe" else [])
    for form in forms:
        _assert_trees_equal(load_mtp(ckpts(model_type, form))[1], fused)
    _assert_trees_equal(load_mtp(ckpts(model_type, "fp8"))[1], load_mtp(ckpts(model_type, "fp8_dequantized"))[1])


def test_fp8_kept_experts_are_the_dequantized_ones(ckpts):
    config, kept = load_mtp(ckpts("qwen3_next", "fp8"), fp8="keep")
    _, plain = load_mtp(ckpts("qwen3_next", "fp8"))
    assert config.expert_dtype == "float8_e4m3fn"
    for name in ("w_gate_up", "w_down"):
        leaf = kept["layers"]["moe"][name]
        assert isinstance(leaf, BlockFP8) and leaf.value.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(dequantize_fp8(leaf, config.fp8_block_size, jnp.float32)),
                                      np.asarray(plain["layers"]["moe"][name]))
    np.testing.assert_array_equal(kept["fc"], plain["fc"])  # the rest dequantized


def test_main_load_skips_the_head_and_load_mtp_reads_only_it(ckpts, monkeypatch):
    """The main loader's weights are those of the same checkpoint without a head (it warns once of the skipped
    tensors); load_mtp reads each head tensor (and FP8 scale) once and nothing else."""
    path = ckpts("qwen3_5_moe", "fp8")
    names = testing.checkpoint_tensors(ckpts.model("qwen3_5_moe"), "fp8", mtp=True)
    head = {n for n in names if n.startswith("mtp.")}
    with pytest.warns(UserWarning, match=f"skipped {len(head)} vision .* MTP .* checkpoint.load_mtp"):
        _, weights = load_hf_checkpoint(path)
    _assert_trees_equal(weights, load_hf_checkpoint(ckpts("qwen3_5_moe", "fp8", mtp=False))[1])
    reads = collections.Counter()
    monkeypatch.setattr(safetensors_io, "READ_HOOKS", [lambda file, name: reads.update([name])])
    load_mtp(path)
    assert reads.keys() == head and set(reads.values()) == {1}


def test_sliced_onto_a_mesh_and_run_there(ckpts):
    """With a mesh, every leaf lands in its layout's shards (EP: one of the 8 experts a device), values as the
    unsharded load's; the head runs under that layout's MoE (dp8_ep8: tokens replicated to the experts) as on one
    device."""
    from qwen35_lib.parallel import shard_weights
    from qwen35_lib.parallel.parallelism import parallelism
    from qwen35_lib.parallel.shardings import shardings
    from qwen35_lib.plan import get_layout, make_mesh

    path = ckpts("qwen3_5_moe", "fp8")
    mesh = make_mesh()
    config, sharded = load_mtp(path, fp8="keep", mesh=mesh, layout="dp8_ep8")
    _, plain = load_mtp(path, fp8="keep")
    plan = get_layout("dp8_ep8").bind(mesh, config)
    want = shardings(declare_mtp(config), plan, mesh)
    for (p, a), (_, s) in zip(path_infos(sharded), path_infos(want), strict=True):
        assert a.sharding.is_equivalent_to(s, a.ndim), p
    _assert_trees_equal(sharded, plain)
    shard = sharded["layers"]["moe"]["w_down"].value.addressable_shards[0].data.shape  # [1, 1, E, F, D]
    assert shard[2] == config.num_experts // len(jax.devices())
    _, weights = load_hf_checkpoint(path, fp8="keep")
    hidden, next_ids = _inputs(config, B=8, T=5, seed=3)
    _, alone = mtp_forward(config, weights, plain, hidden, next_ids)
    with jax.set_mesh(mesh):
        _, got = mtp_forward(config, shard_weights(config, plan, weights, mesh), sharded, hidden, next_ids,
                             parallelism=parallelism(plan))
    np.testing.assert_allclose(np.asarray(got), np.asarray(alone), atol=1e-6)  # float32; the expert sums' order


def test_errors_name_the_head(ckpts, tmp_path):
    with pytest.raises(CheckpointError, match="no multi-token-prediction head .*serve without MTP"):
        load_mtp(ckpts("qwen3_5_moe", "fused", mtp=False))
    src = ckpts("qwen3_5_moe", "fused")
    with pytest.raises(CheckpointError, match=r"1 tensors that config.json implies are missing: mtp\.norm\.weight"):
        load_mtp(edited(src, tmp_path / "missing", drop=["mtp.norm.weight"]))
    extra = {"mtp.layers.1.input_layernorm.weight": np.zeros(64, np.float32)}
    with pytest.raises(CheckpointError, match=r"1 MTP tensors are not weights of a one-layer .*layers\.1\.input"):
        load_mtp(edited(src, tmp_path / "extra", add=extra))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight: config.json implies \(64, 128\), the file has"):
        load_mtp(edited(src, tmp_path / "shape", add={"mtp.fc.weight": np.zeros((64, 64), np.float32)}))
