"""The test factory: tiny random HF models and their checkpoints in every on-disk form we load.

Used by the tests and the notebooks alike. torch and transformers are imported inside the functions, so
importing this module costs nothing without the `reference` extra.

    model = make_hf_model("qwen3_5_moe")               # Qwen3_5MoeForCausalLM, eval(), seeded
    path = save_hf_checkpoint(model, tmp / "ckpt", "fused")
    config, weights = load_hf_checkpoint(path)

Forms (`FORMS`):
- "per_expert": what `save_pretrained` writes (experts as `mlp.experts.{e}.{gate,up,down}_proj.weight`);
- "fused": experts as 3-D `mlp.experts.gate_up_proj [E, 2F, D]` / `down_proj [E, D, F]`, as the real Qwen3.5
  bf16 checkpoints store them;
- "language_model" (Qwen3.5 only): the VL layout: nested config.json (`qwen3_5_moe` + `text_config`), tensors under
  `model.language_model.`, fused experts, a few `model.visual.*` tensors a loader must skip, and an MTP head (as
  the published Qwen3.5 checkpoints: its experts per expert);
- "sharded": per-expert tensors in `num_shards` files with `model.safetensors.index.json`;
- "fp8": block-scaled FP8 (e4m3) of every 2-D linear weight except the embedding, lm_head and router, with
  `*.weight_scale_inv` (`w = q * scale_inv`), per-expert experts, a `quantization_config`;
- "fp8_dequantized": the same FP8-rounded weights, dequantized to float32: the FP8 checkpoint's exact twin.
`fp8_round_trip(model)` gives that twin as an HF model, for logits comparisons.
`mtp=True` (any form; the "language_model" form always) adds a random multi-token-prediction head (`mtp_tensors`:
`mtp.*`, of the model's shapes, named as the published checkpoints name it), stored in the form's way (experts
fused or per expert, FP8); transformers has no MTP module, so the head's values are drawn here, seeded.
`read_raw_safetensors` / `write_raw_safetensors` / `edit_header` take a file apart and put it back unchecked,
for tests of broken files.
`make_tokenizer_dir(root)` writes a byte-level tokenizer for the tiny 256-id vocabulary with a ChatML template (the
serve tests' and `bench serve-stress`'s).
"""

from __future__ import annotations

import copy
import json
import pathlib
import struct
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from qwen35_lib import safetensors_io
from qwen35_lib.weights import FP8_MAX

FORMS = ("per_expert", "fused", "language_model", "sharded", "fp8", "fp8_dequantized")
FP8_BLOCK = 16  # tiny shapes get several blocks per matrix, and partial ones (in_proj_b/a: 4 rows)
# Norm and decay parameters that HF initialises to constants (0 or 1); make_hf_model perturbs them.
PERTURBED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
             "model.norm.weight", "linear_attn.norm.weight", "A_log", "dt_bias")
FAKE_SKIPPED = {  # VL form: tensors of the vision tower, which a text loader skips (shapes do not matter)
    "model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4),
    "model.visual.blocks.0.attn.qkv.weight": (48, 16),
}
MTP_SEED = 54  # the heads' values (`mtp_tensors`)


def tiny_hf_config(model_type: str = "qwen3_5_moe", **overrides: Any) -> Any:
    """A transformers config matching our `qwen3.5-tiny` preset (fields in `overrides` replace the defaults).

    vocab 256, hidden 64, 4 layers (3 GDN + 1 attention), 4 q / 2 kv heads of 32, GDN 2 key / 4 value heads of
    16 / 24, conv 4, 8 experts top-3 of 32, shared expert 48, RoPE theta 1e7 on a quarter of each head, EOS 1.
    """
    import transformers

    fields = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=4096,
        rms_norm_eps=1e-6, eos_token_id=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return transformers.Qwen3_5MoeTextConfig(**{**fields, **overrides})
    if model_type == "qwen3_next":
        fields.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        return transformers.Qwen3NextConfig(**{**fields, **overrides})
    raise ValueError(f"unknown model_type {model_type!r}; use 'qwen3_5_moe' or 'qwen3_next'")


def make_hf_model(model_type: str = "qwen3_5_moe", seed: int = 0, dtype: Any = None, **overrides: Any) -> Any:
    """A seeded random `Qwen3_5MoeForCausalLM` / `Qwen3NextForCausalLM` in eval mode.

    1. Build the model under `torch.manual_seed(seed)` (HF's own init: normal(0.02) matrices).
    2. Add 0.1 * N(0, 1) to every parameter HF initialises to a constant (zero-centred norms at 0, the gated
       norm and dt_bias at 1) and to A_log, so a loader that drops or swaps them cannot go unnoticed.
    3. Cast to `dtype` (default float32; a torch dtype or its name) and record it in the config.
    """
    import torch
    import transformers

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
    config = tiny_hf_config(model_type, **overrides)
    cls = transformers.Qwen3NextForCausalLM if model_type == "qwen3_next" else transformers.Qwen3_5MoeForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(PERTURBED):
                    param.add_(0.1 * torch.randn(param.shape))
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    return model


def checkpoint_tensors(model: Any, form: str = "per_expert", fp8_block: int = FP8_BLOCK,
                       mtp: bool | None = None) -> dict[str, np.ndarray]:
    """The tensors `save_hf_checkpoint(model, path, form, mtp=mtp)` writes, as numpy arrays (bfloat16 via ml_dtypes).

    1. The model's state dict (fused experts, `model.` prefix), with an MTP head when `mtp` (None: only in the
    "language_model" form, where its experts are split per expert); 2. split experts per expert unless the form
    keeps them fused; 3. FP8 forms: quantize (or round-trip) the linear weights; 4. the VL form: re-prefix and
    add the vision tensors.
    """
    check_form(model, form)
    sd = {name: _to_numpy(t) for name, t in model.state_dict().items()}
    if mtp or (mtp is None and form == "language_model"):
        head = mtp_tensors(model.config, sd["model.embed_tokens.weight"].dtype)
        sd.update(split_experts(head) if form == "language_model" else head)
    if form not in ("fused", "language_model"):
        sd = split_experts(sd)
    if form in ("fp8", "fp8_dequantized"):
        out = {}
        for name, w in sd.items():
            if not is_quantized(name, w):
                out[name] = w
                continue
            q, scale = quantize_fp8_blocks(w.astype(np.float32), fp8_block)
            if form == "fp8":
                out[name], out[name[: -len(".weight")] + ".weight_scale_inv"] = q, scale
            else:
                out[name] = dequantize_fp8_blocks(q, scale, fp8_block)
        sd = out
    if form == "language_model":
        sd = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): w for n, w in sd.items()}
        rng = np.random.default_rng(0)
        sd.update({n: rng.standard_normal(s).astype(np.float32) for n, s in FAKE_SKIPPED.items()})
    return sd


def save_hf_checkpoint(model: Any, path: str | pathlib.Path, form: str = "per_expert", *,
                       fp8_block: int = FP8_BLOCK, num_shards: int = 3, mtp: bool | None = None) -> pathlib.Path:
    """Write `model` as an HF checkpoint directory in one of `FORMS`; returns the directory.

    Every form has config.json and generation_config.json. "per_expert" is `model.save_pretrained(path)` itself
    (with `mtp`, the same tensors and the head, written here). `mtp`: add an MTP head (`checkpoint_tensors`).
    """
    path = pathlib.Path(path)
    check_form(model, form)
    if form == "per_expert" and not mtp:
        model.save_pretrained(path)
        return path
    path.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, form, fp8_block, mtp)
    config = model.config.to_dict()
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    config["architectures"] = [type(model).__name__]
    if form == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [fp8_block, fp8_block]}
    if form == "language_model":
        import transformers

        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=config["hidden_size"],
                      patch_size=4)
        vl = transformers.Qwen3_5MoeConfig(text_config=config, vision_config=vision).to_dict()
        vl.update(architectures=["Qwen3_5MoeForConditionalGeneration"], dtype=config["dtype"])
        config = vl
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(path)
    if form != "sharded":
        safetensors_io.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    chunks = [names[k::num_shards] for k in range(num_shards)]  # interleaved: every file holds some of each layer
    weight_map = {}
    for k, chunk in enumerate(chunks):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        safetensors_io.save_file({n: tensors[n] for n in chunk}, path / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return path


def fp8_round_trip(model: Any, fp8_block: int = FP8_BLOCK) -> Any:
    """A copy of `model` whose weights are those of its "fp8" checkpoint, dequantized (the twin, in memory)."""
    import torch

    twin = copy.deepcopy(model)
    sd = checkpoint_tensors(model, "fp8_dequantized", fp8_block)
    sd = fuse_experts(sd)
    with torch.no_grad():
        for name, param in twin.state_dict().items():
            param.copy_(torch.from_numpy(np.asarray(sd[name], np.float32)).to(param.dtype))
    return twin


def mtp_tensors(hf_config: Any, dtype: Any = np.float32, seed: int = MTP_SEED) -> dict[str, np.ndarray]:
    """A random multi-token-prediction head for the HF text config `hf_config` (its `text_config` for a VL one), as
    the published checkpoints store it (vLLM's Qwen3.5 / Qwen3-Next MTP modules), experts fused:

        mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight, mtp.norm.weight   [D]
        mtp.fc.weight                                                                      [D, 2D]
        mtp.layers.0.{input_layernorm, post_attention_layernorm}.weight                    [D]
        mtp.layers.0.self_attn.{q_proj [2 Hq hd, D] (per head [query | gate]), k_proj / v_proj [Hkv hd, D],
                                o_proj [D, Hq hd], q_norm / k_norm [hd]}
        mtp.layers.0.mlp.{gate [E, D], experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F],
                          shared_expert.{gate_proj, up_proj} [Fs, D], shared_expert.down_proj [D, Fs],
                          shared_expert_gate [1, D]}

    Matrices normal(0.02) as HF initialises them, but the router normal(0.2), so that no token's top-k is a near
    tie that float32 and float64 could break apart; the zero-centred norms 0.1 * normal. Cast to `dtype`.
    """
    c = getattr(hf_config, "text_config", None) or hf_config
    D, Hq, Hkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    E, F, Fs = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    rng = np.random.default_rng(seed)
    mat = lambda *shape, std=0.02: std * rng.standard_normal(shape)
    norm = lambda n: 0.1 * rng.standard_normal(n)
    layer, attn, mlp = "mtp.layers.0.", "mtp.layers.0.self_attn.", "mtp.layers.0.mlp."
    head = {
        "mtp.pre_fc_norm_embedding.weight": norm(D), "mtp.pre_fc_norm_hidden.weight": norm(D),
        "mtp.fc.weight": mat(D, 2 * D),
        layer + "input_layernorm.weight": norm(D), layer + "post_attention_layernorm.weight": norm(D),
        attn + "q_proj.weight": mat(2 * Hq * hd, D), attn + "k_proj.weight": mat(Hkv * hd, D),
        attn + "v_proj.weight": mat(Hkv * hd, D), attn + "o_proj.weight": mat(D, Hq * hd),
        attn + "q_norm.weight": norm(hd), attn + "k_norm.weight": norm(hd),
        mlp + "gate.weight": mat(E, D, std=0.2),
        mlp + "experts.gate_up_proj": mat(E, 2 * F, D), mlp + "experts.down_proj": mat(E, D, F),
        mlp + "shared_expert.gate_proj.weight": mat(Fs, D), mlp + "shared_expert.up_proj.weight": mat(Fs, D),
        mlp + "shared_expert.down_proj.weight": mat(D, Fs), mlp + "shared_expert_gate.weight": mat(1, D),
        "mtp.norm.weight": norm(D),
    }
    return {n: w.astype(np.float32).astype(dtype) for n, w in head.items()}


# ---------------------------------------------------------------------------------------------------------------
# Raw safetensors files, for tests of broken ones (nothing here checks anything)


def read_raw_safetensors(path: str | pathlib.Path) -> tuple[dict, bytes]:
    """A safetensors file as (its JSON header, its data section's bytes)."""
    raw = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw_safetensors(path: str | pathlib.Path, header: dict | bytes, data: bytes = b"",
                          length: int | None = None) -> None:
    """Write `header` (a dict, as JSON; or bytes as they are) and `data` with the 8-byte length `length`
    (default: the header's true length), whatever they hold."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


def edit_header(path: str | pathlib.Path, edit: Callable[[dict], Any]) -> None:
    """Rewrite a safetensors file's header in place: `edit(header)` changes the dict (or returns a new one)."""
    header, data = read_raw_safetensors(path)
    new = edit(header)
    write_raw_safetensors(path, header if new is None else new, data)


# ---------------------------------------------------------------------------------------------------------------
# Block-scaled FP8, written independently of qwen35_lib.weights so the tests check one against the other.


def quantize_fp8_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """`w [out, in]` float32 -> (q float8_e4m3fn [out, in], scale_inv float32 [cdiv(out, b), cdiv(in, b)]).

    Per block: scale = amax / 448 (1 for an all-zero block), q = w / scale rounded to e4m3; so w ~= q * scale.
    """
    out, inn = w.shape
    co, ci = -(-out // block), -(-inn // block)
    padded = np.zeros((co * block, ci * block), np.float32)
    padded[:out, :inn] = w
    tiles = padded.reshape(co, block, ci, block)
    amax = np.abs(tiles).max(axis=(1, 3))  # [co, ci]
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = (tiles / scale[:, None, :, None]).reshape(padded.shape)[:out, :inn].astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantize_fp8_blocks(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """q * scale_inv, each scale covering a `block` x `block` tile; float32."""
    full = np.kron(scale, np.ones((block, block), np.float32))[: q.shape[0], : q.shape[1]]
    return q.astype(np.float32) * full


# ---------------------------------------------------------------------------------------------------------------


def check_form(model: Any, form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"unknown checkpoint form {form!r}; forms: {', '.join(FORMS)}")
    if form == "language_model" and model.config.model_type == "qwen3_next":
        raise ValueError("Qwen3-Next has no vision-language checkpoint; the 'language_model' form is Qwen3.5 only")


def _to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: go through float32 (exact both ways)
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy().copy()


def split_experts(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fused `experts.gate_up_proj [E, 2F, D]` / `experts.down_proj [E, D, F]` -> per-expert `.weight`s."""
    out = {}
    for name, w in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, F = name[: -len("gate_up_proj")], w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = w[e, :F], w[e, F:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            out.update({f"{base}{e}.down_proj.weight": w[e] for e in range(w.shape[0])})
        else:
            out[name] = w
    return out


def fuse_experts(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `split_experts` (what HF's conversion mapping does on load)."""
    out, experts = {}, {}
    for name, w in sd.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = w
            continue
        e, proj = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = w
    for head, projs in experts.items():
        E = len(projs["down_proj"])
        out[f"{head}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(E)])
        out[f"{head}.mlp.experts.down_proj"] = np.stack([projs["down_proj"][e] for e in range(E)])
    return out


def is_quantized(name: str, w: np.ndarray) -> bool:
    """Whether the "fp8" form stores `name` in FP8: 2-D linear weights but the embedding, lm_head and router."""
    return (w.ndim == 2 and name.endswith(".weight")
            and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")))


# --- a tokenizer for the tiny vocabulary -----------------------------------------------------------------------
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SKIPPED_BYTES = (1, 2, 3)  # left out so that 253 bytes + 3 specials = 256 ids, the tiny model's vocabulary
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def make_tokenizer_dir(root: pathlib.Path, template: str = CHATML) -> pathlib.Path:
    """tokenizer.json (byte-level BPE over 253 bytes, no merges, 3 special tokens: ids 253-255: the tiny model's
    256-id vocabulary) and tokenizer_config.json with `template` as its chat template, under `root`; `tokenizers` is
    imported here, not with the module."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    vocab = {chars[b]: i for i, b in enumerate(b for b in range(256) if b not in SKIPPED_BYTES)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>"}))
    return root
