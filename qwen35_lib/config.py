"""The model configuration: one frozen, hashable dataclass, its presets, and `from_hf_config`.

A `Config` holds names and numbers, never devices or arrays, so it can be a static argument of `jax.jit`.
Sizes that follow from the weights (parameter counts, bytes) live in `qwen35_lib.stats`, computed from the
weight declarations in `qwen35_lib.weights`, never typed in here.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

LINEAR = "linear_attention"  # a Gated DeltaNet layer
FULL = "full_attention"  # a gated GQA attention layer

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
DTYPES = ("float32", "bfloat16")
EXPERT_DTYPES = (None, "float8_e4m3fn")
LAYOUTS = ("single", "tp8", "tp8_kvrep", "dp4_tp2_ep8", "dp8_ep8")  # see qwen35_lib.parallel.layouts
ROUTINGS = ("replicate", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of a Qwen3.5 MoE / Qwen3-Next text model, plus how to run it.

    The layer stack repeats `layer_pattern` `num_groups` times (Qwen3.5: 3 x GDN + 1 x attention), which lets
    the decoder scan over groups so that compile time does not grow with depth.
    Fields that do not change the computation (name, model_type, EOS ids, max positions) are left out of
    equality and hashing, so two checkpoints of the same shape share compiled programs.
    """

    name: str = dataclasses.field(compare=False)
    # "qwen3_5_moe" or "qwen3_next": they differ only in how GDN projections are stored on disk
    model_type: str = dataclasses.field(default="qwen3_5_moe", compare=False)
    vocab_size: int = 248320
    hidden_size: int = 4096
    num_layers: int = 60
    layer_pattern: tuple[str, ...] = (LINEAR, LINEAR, LINEAR, FULL)
    # gated GQA attention
    num_q_heads: int = 32
    num_kv_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    # Gated DeltaNet
    gdn_num_k_heads: int = 16
    gdn_num_v_heads: int = 64
    gdn_k_head_dim: int = 128
    gdn_v_head_dim: int = 128
    gdn_conv_kernel: int = 4
    gdn_chunk_size: int = 64
    # MoE
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_ffn: int = 1024
    shared_ffn: int = 1024
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = dataclasses.field(default=262144, compare=False)
    eos_token_ids: tuple[int, ...] = dataclasses.field(default=(), compare=False)
    # how to run it
    dtype: str = "bfloat16"  # weights and activations
    expert_dtype: str | None = None  # None: as `dtype`; "float8_e4m3fn": block-scaled FP8 expert weights
    fp8_block_size: int = 128  # FP8 scale block (both matrix dims)
    gdn_state_dtype: str = "float32"  # recurrent GDN state (tpu-inference keeps bf16)
    attention_kernel: str = "auto"  # kernel registry slot names: see qwen35_lib.kernels
    moe_kernel: str = "auto"
    gdn_kernel: str = "auto"
    permute_kernel: str = "auto"
    # how to run it on many devices (qwen35_lib.parallel); the mesh itself is passed where it is used
    layout: str = "single"  # single | tp8 | tp8_kvrep | dp4_tp2_ep8 | dp8_ep8
    routing: str = "replicate"  # EP layouts: replicate (all-gather tokens) | all_to_all (send tokens to experts)
    fuse_allgather: bool = False  # replicate: top-k ids and weights in one all-gather (3 all-gathers -> 2)
    hierarchical_rs: bool = False  # replicate: reduce-scatter over `core`, then over `chip`, micro-batched
    capacity_factor: float | None = None  # all_to_all: None = dropless; else slots per device = f * mean (drops)

    def __post_init__(self):
        _check(self.model_type in MODEL_TYPES, f"unknown model_type {self.model_type!r}; expected one of {MODEL_TYPES}")
        _check(self.dtype in DTYPES, f"dtype {self.dtype!r} is not supported; use one of {DTYPES}")
        _check(self.expert_dtype in EXPERT_DTYPES, f"expert_dtype {self.expert_dtype!r}; use one of {EXPERT_DTYPES}")
        _check(self.gdn_state_dtype in DTYPES, f"gdn_state_dtype {self.gdn_state_dtype!r}; use one of {DTYPES}")
        _check(set(self.layer_pattern) <= {LINEAR, FULL}, f"layer_pattern entries must be {LINEAR!r} or {FULL!r}")
        _check(self.num_layers % len(self.layer_pattern) == 0,
               f"num_layers={self.num_layers} is not a whole number of {len(self.layer_pattern)}-layer groups")
        _check(self.num_q_heads % self.num_kv_heads == 0,
               f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        _check(self.gdn_num_v_heads % self.gdn_num_k_heads == 0,
               f"gdn_num_v_heads={self.gdn_num_v_heads} is not a multiple of gdn_num_k_heads={self.gdn_num_k_heads}")
        _check(0 < self.num_experts_per_tok <= self.num_experts,
               f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")
        _check(self.layout in LAYOUTS, f"unknown layout {self.layout!r}; use one of {LAYOUTS}")
        _check(self.routing in ROUTINGS, f"unknown routing {self.routing!r}; use one of {ROUTINGS}")
        _check(self.capacity_factor is None or self.capacity_factor > 0,
               f"capacity_factor must be None (dropless) or > 0; got {self.capacity_factor}")
        _check(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
               f"partial_rotary_factor={self.partial_rotary_factor} gives an odd or empty rotary dim")

    # --- derived shapes (not sizes: those come from the weight declarations) ---
    @property
    def num_groups(self) -> int:
        return self.num_layers // len(self.layer_pattern)

    @property
    def layer_types(self) -> tuple[str, ...]:
        return self.layer_pattern * self.num_groups

    @property
    def gdn_per_group(self) -> int:
        return self.layer_pattern.count(LINEAR)

    @property
    def attn_per_group(self) -> int:
        return self.layer_pattern.count(FULL)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_num_k_heads * self.gdn_k_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_num_v_heads * self.gdn_v_head_dim

    @property
    def gdn_conv_dim(self) -> int:  # channels of the depthwise conv: [q | k | v]
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# ---------------------------------------------------------------------------------------------------------------
# Presets. Sources: ../shared/reference/qwen35_architecture.md section 1.
PRESETS: dict[str, Config] = {}


def _preset(cfg: Config) -> Config:
    PRESETS[cfg.name] = cfg
    return cfg


QWEN35_397B = _preset(Config(name="qwen3.5-397b-a17b", eos_token_ids=(248046, 248044)))
QWEN35_122B = _preset(Config(
    name="qwen3.5-122b-a10b", hidden_size=3072, num_layers=48, num_experts=256, num_experts_per_tok=8,
    eos_token_ids=(248046, 248044)))
QWEN35_35B = _preset(Config(
    name="qwen3.5-35b-a3b", hidden_size=2048, num_layers=40, num_q_heads=16, gdn_num_v_heads=32, num_experts=256,
    num_experts_per_tok=8, moe_ffn=512, shared_ffn=512, eos_token_ids=(248046, 248044)))
QWEN3_NEXT_80B = _preset(Config(
    name="qwen3-next-80b-a3b", model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_layers=48,
    num_q_heads=16, gdn_num_v_heads=32, moe_ffn=512, shared_ffn=512, rope_theta=5_000_000.0,
    eos_token_ids=(151645,)))
# CPU sizes. `qwen3.5-mini` is the CPU benchmark model (~115M parameters); `qwen3.5-tiny` is for tests.
QWEN35_MINI = _preset(Config(
    name="qwen3.5-mini", vocab_size=4096, hidden_size=512, num_layers=8, num_q_heads=8, num_kv_heads=2, head_dim=64,
    gdn_num_k_heads=4, gdn_num_v_heads=8, gdn_k_head_dim=64, gdn_v_head_dim=64, num_experts=64,
    num_experts_per_tok=8, moe_ffn=128, shared_ffn=128, max_position_embeddings=32768, eos_token_ids=(1,)))
QWEN35_TINY = _preset(Config(
    name="qwen3.5-tiny", vocab_size=256, hidden_size=64, num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=32,
    gdn_num_k_heads=2, gdn_num_v_heads=4, gdn_k_head_dim=16, gdn_v_head_dim=24, num_experts=8,
    num_experts_per_tok=3, moe_ffn=32, shared_ffn=48, max_position_embeddings=4096, eos_token_ids=(1,)))


def get_config(name: str, **changes: Any) -> Config:
    """A preset by name, optionally with fields replaced (`get_config("qwen3.5-tiny", dtype="float32")`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**changes) if changes else PRESETS[name]


# ---------------------------------------------------------------------------------------------------------------
# HF config.json


def from_hf_config(hf: dict | str | pathlib.Path, name: str | None = None, **changes: Any) -> Config:
    """A `Config` from an HF `config.json` (a dict, the file, or the checkpoint directory holding it).

    Reads the nested Qwen3.5 form (`model_type` `qwen3_5_moe` with `text_config`), its text-only form
    (`qwen3_5_moe_text`) and the flat Qwen3-Next form (`qwen3_next`). `changes` override fields (e.g. `dtype`).
    """
    if not isinstance(hf, dict):
        path = pathlib.Path(hf)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        hf = json.loads(path.read_text())
    top_type = hf.get("model_type")
    if top_type == "qwen3_5_moe":
        if "text_config" not in hf:
            raise ValueError("config.json has model_type 'qwen3_5_moe' but no 'text_config'")
        text = dict(hf["text_config"])
        text.setdefault("model_type", "qwen3_5_moe_text")
        for key in ("quantization_config", "torch_dtype", "dtype", "eos_token_id"):  # may live at the top level
            if key in hf and key not in text:
                text[key] = hf[key]
    elif top_type in ("qwen3_5_moe_text", "qwen3_next"):
        text = hf
    else:
        raise ValueError(
            f"unknown model_type {top_type!r} in config.json; this library loads Qwen3.5 MoE "
            "('qwen3_5_moe', 'qwen3_5_moe_text') and Qwen3-Next ('qwen3_next') checkpoints")
    model_type = "qwen3_next" if top_type == "qwen3_next" else "qwen3_5_moe"

    def get(key: str, default: Any = None) -> Any:
        if key in text:
            return text[key]
        if default is None:
            raise ValueError(f"config.json lacks the field {key!r} needed for a {top_type} model")
        return default

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000.0))
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if rope.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (only the default RoPE)")
    num_layers = int(get("num_hidden_layers"))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    pattern = _find_pattern(tuple(layer_types))
    if model_type == "qwen3_next":
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
            raise ValueError("Qwen3-Next configs with dense (mlp_only) layers are not supported: "
                             "every layer must be MoE")
    eos = text.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    hf_dtype = text.get("dtype") or text.get("torch_dtype") or "bfloat16"
    quant = text.get("quantization_config") or {}
    fields = dict(
        name=name or text.get("_name_or_path") or f"hf-{model_type}",
        model_type=model_type,
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        num_layers=num_layers,
        layer_pattern=pattern,
        num_q_heads=int(get("num_attention_heads")),
        num_kv_heads=int(get("num_key_value_heads")),
        head_dim=int(text.get("head_dim") or int(get("hidden_size")) // int(get("num_attention_heads"))),
        rope_theta=float(rope_theta),
        partial_rotary_factor=float(partial),
        gdn_num_k_heads=int(get("linear_num_key_heads")),
        gdn_num_v_heads=int(get("linear_num_value_heads")),
        gdn_k_head_dim=int(get("linear_key_head_dim")),
        gdn_v_head_dim=int(get("linear_value_head_dim")),
        gdn_conv_kernel=int(get("linear_conv_kernel_dim")),
        num_experts=int(get("num_experts")),
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_ffn=int(get("moe_intermediate_size")),
        shared_ffn=int(get("shared_expert_intermediate_size")),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        eos_token_ids=eos_ids,
        dtype="float32" if hf_dtype == "float32" else "bfloat16",
    )
    if quant:
        block = quant.get("weight_block_size") or [128, 128]
        if block[0] != block[1]:
            raise ValueError(f"FP8 weight_block_size {block} is not square; only square blocks are supported")
        fields["fp8_block_size"] = int(block[0])
    fields.update(changes)
    return Config(**fields)


def _find_pattern(layer_types: tuple[str, ...]) -> tuple[str, ...]:
    """The shortest repeating unit of `layer_types` (the decoder scans over repeats of it)."""
    unknown = set(layer_types) - {LINEAR, FULL}
    if unknown:
        raise ValueError(f"unknown layer types {sorted(unknown)}; expected {LINEAR!r} or {FULL!r}")
    n = len(layer_types)
    for p in range(1, n + 1):
        if n % p == 0 and layer_types == layer_types[:p] * (n // p):
            return layer_types[:p]
    raise AssertionError("unreachable")
