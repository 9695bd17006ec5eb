"""The model configuration: one frozen, hashable dataclass, its presets, and `from_hf_config`.

A `Config` holds names and numbers, never devices or arrays, so it can be a static argument of `jax.jit`.
Sizes that follow from the weights (parameter counts, bytes) live in `qwen35_lib.stats`, computed from the
weight declarations in `qwen35_lib.weights`, never typed in here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import pathlib
import stat
from typing import Any

LINEAR = "linear_attention"  # a Gated DeltaNet layer
FULL = "full_attention"  # a gated GQA attention layer

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
DTYPES = ("float32", "bfloat16")
EXPERT_DTYPES = (None, "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of a Qwen3.5 MoE / Qwen3-Next text model: the checkpoint's shapes and dtypes. How it is served
    (layout, routing, collectives, kernels) is a `qwen35_lib.plan.ServingPlan`, never a field here.

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
    # dtypes
    dtype: str = "bfloat16"  # weights and activations
    expert_dtype: str | None = None  # None: as `dtype`; "float8_e4m3fn": block-scaled FP8 expert weights
    fp8_block_size: int = 128  # FP8 scale block (both matrix dims)
    gdn_state_dtype: str = "float32"  # recurrent GDN state (tpu-inference keeps bf16)

    def __post_init__(self):
        _check_types(self)
        for f in _POSITIVE:
            _check(getattr(self, f) >= 1, f"{f}={getattr(self, f)} must be at least 1")
        _check(len(self.layer_pattern) >= 1, "layer_pattern is empty; it needs at least one layer type")
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


class ConfigError(ValueError):
    """A configuration that cannot describe a model: a Config field, config.json or generation_config.json
    (one line: the file and field, what is wrong, the fix)."""


# Config fields that count something: each at least 1 (checked before anything divides by them)
_POSITIVE = ("vocab_size", "hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "gdn_num_k_heads",
             "gdn_num_v_heads", "gdn_k_head_dim", "gdn_v_head_dim", "gdn_conv_kernel", "gdn_chunk_size", "num_experts",
             "num_experts_per_tok", "moe_ffn", "shared_ffn", "max_position_embeddings", "fp8_block_size")
_TYPES = {"int": (numbers.Integral,), "float": (numbers.Real,), "bool": (bool,), "str": (str,),
          "str | None": (str, type(None)), "float | None": (numbers.Real, type(None))}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_types(config: Config) -> None:
    """Each scalar field has its annotated type (bool is no int; numpy integers are)."""
    for f in dataclasses.fields(config):
        v, allowed = getattr(config, f.name), _TYPES.get(str(f.type))
        if allowed is None:
            continue
        bad_bool = isinstance(v, bool) and bool not in allowed
        _check(isinstance(v, allowed) and not bad_bool, f"Config field {f.name}={v!r} is a {type(v).__name__}; "
               f"it must be {str(f.type).replace(' | ', ' or ')}")


# ---------------------------------------------------------------------------------------------------------------
# Presets. Sources: each checkpoint's config.json (text_config) on the Hugging Face Hub, and HF transformers'
# configuration_qwen3_5_moe.py / configuration_qwen3_next.py for the fields they leave at their defaults.
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
        raise ConfigError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**changes) if changes else PRESETS[name]


# ---------------------------------------------------------------------------------------------------------------
# HF config.json


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """The value in a JSON file; a `ConfigError` naming the file, line and column when it is not valid JSON, and
    a refusal (without blocking) when it is not a regular file (a symlink to one is fine)."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"no {what} at {path}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path}: not a regular file; the {what} must be a plain file (or a symlink to one)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (bad byte at offset {e.start}); restore the {what}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}; fix the {what} "
                          "there or download it again") from None
    except ValueError as e:  # _no_constant
        raise ConfigError(f"{path}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to be a {what}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"holds the constant {name}, which is not valid JSON")


def _json_type(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(x), type(x).__name__)


_REQUIRED = object()


class _Fields:
    """Typed reads of config.json fields; every error names the file and the field (`text_config.x` when nested)."""

    def __init__(self, text: dict, where: str, prefix: str, copied: set[str], model: str):
        self.text, self.where, self.prefix, self.copied, self.model = text, where, prefix, copied, model

    def name(self, key: str) -> str:
        return key if key in self.copied else self.prefix + key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {self.name(key)} {message}")

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        v = self.text.get(key)
        if v is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.where}: lacks the field {self.name(key)!r} needed for a {self.model} model; "
                                  "use the checkpoint's own config.json")
            return default
        return v

    def int(self, key: str, default: Any = _REQUIRED, low: int | None = 1) -> Any:
        if self.text.get(key) is None and default is not _REQUIRED:
            return default
        v = self.raw(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(key, f"is {_show(v)} ({_json_type(v)}); it must be an integer")
        if low is not None and v < low:
            raise self.fail(key, f"is {v}; it must be at least {low}")
        return v

    def float(self, key: str, v: Any, low_exclusive: float = 0.0, high: float = math.inf) -> float:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise self.fail(key, f"is {_show(v)} ({_json_type(v)}); it must be a number")
        if not (math.isfinite(v) and low_exclusive < v <= high):  # JSON's 1e400 parses as inf
            rng = f"in ({low_exclusive}, {high}]" if high < math.inf else f"finite and above {low_exclusive}"
            raise self.fail(key, f"is {v}; it must be {rng}")
        return float(v)

    def of(self, key: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
        v = self.text.get(key)
        if v is None:
            return default
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise self.fail(key, f"is {_show(v)} ({_json_type(v)}); it must be {what}")
        return v


def _show(v: Any, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _read_hf(hf: dict | str | os.PathLike, source: str | None) -> tuple[dict, str]:
    """(the config.json object, how errors name its file): a dict as given, or read from a file or its folder."""
    if isinstance(hf, (str, os.PathLike)):
        path = pathlib.Path(hf)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        source = source or str(path)
        hf = read_json(path, "config.json")
    where = source or "config.json"
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: holds {_json_type(hf)}, not a JSON object of model fields; use the "
                          "checkpoint's own config.json")
    return hf, where


def _text_config(hf: dict, where: str) -> tuple[dict, set[str], str]:
    """(the text model's fields, the keys copied into them from the top level, their prefix in errors) of the nested
    Qwen3.5 form (`text_config`), its text-only form or the flat Qwen3-Next one."""
    top_type = hf.get("model_type")
    if top_type in ("qwen3_5_moe_text", "qwen3_next"):
        return hf, set(), ""
    if top_type != "qwen3_5_moe":
        raise ConfigError(
            f"{where}: unknown model_type {_show(top_type)}; this library loads Qwen3.5 MoE "
            "('qwen3_5_moe', 'qwen3_5_moe_text') and Qwen3-Next ('qwen3_next') checkpoints")
    if not isinstance(hf.get("text_config"), dict):
        raise ConfigError(f"{where}: model_type 'qwen3_5_moe' needs a 'text_config' object, found "
                          f"{_json_type(hf.get('text_config'))}; use the checkpoint's own config.json")
    text = dict(hf["text_config"])
    text.setdefault("model_type", "qwen3_5_moe_text")
    copied = {k for k in ("quantization_config", "torch_dtype", "dtype", "eos_token_id")  # may live at the top
              if k in hf and k not in text}
    text.update({k: hf[k] for k in copied})
    return text, copied, "text_config."


def _rope(r: _Fields, text: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor), each from the rope object (`rope_parameters` / `rope_scaling`), else
    the top level; only the default RoPE."""
    rope = r.of("rope_parameters", (dict,), "an object", {}) or r.of("rope_scaling", (dict,), "an object", {})
    rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", None):
        raise r.fail(rope_key, f"has rope_type {_show(rope_type)}, which is not supported (only the default RoPE)")

    def rope_field(key: str, default: float, high: float = math.inf) -> float:
        if key in rope:
            return r.float(f"{rope_key}.{key}", rope[key], high=high)
        return r.float(key, r.raw(key, default), high=high)

    return rope_field("rope_theta", 10_000.0), rope_field("partial_rotary_factor", 0.25, high=1.0)


def _layer_types(r: _Fields, num_layers: int) -> list[str]:
    """Each layer's kind: `layer_types`, else every `full_attention_interval`-th layer full attention."""
    layer_types = r.of("layer_types", (list,), "a list of layer types")
    if layer_types is None:
        interval = r.int("full_attention_interval", 4)
        layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    elif len(layer_types) != num_layers:
        raise r.fail("layer_types", f"lists {len(layer_types)} layers but num_hidden_layers is {num_layers}; they "
                     "must agree")
    bad = [t for t in layer_types if t not in (LINEAR, FULL)]
    if bad:
        raise r.fail("layer_types", f"holds {_show(bad[0])}; each entry must be {LINEAR!r} or {FULL!r}")
    return layer_types


def from_hf_config(hf: dict | str | pathlib.Path, name: str | None = None, *, source: str | None = None,
                   **changes: Any) -> Config:
    """A `Config` from an HF `config.json` (a dict, the file, or the checkpoint directory holding it).

    Reads the nested Qwen3.5 form (`model_type` `qwen3_5_moe` with `text_config`), its text-only form
    (`qwen3_5_moe_text`) and the flat Qwen3-Next form (`qwen3_next`). `changes` override fields (e.g. `dtype`).
    source: how errors name a dict's file (default "config.json"; the file's path when a path is given).
    Every field is type- and range-checked: a wrong one is a `ConfigError` naming the file, the field and the fix.
    """
    hf, where = _read_hf(hf, source)
    known = [f.name for f in dataclasses.fields(Config)]
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ConfigError(f"unknown Config fields {unknown}; the fields are those of qwen35_lib.config.Config")
    text, copied, prefix = _text_config(hf, where)
    top_type = hf.get("model_type")
    model_type = "qwen3_next" if top_type == "qwen3_next" else "qwen3_5_moe"
    r = _Fields(text, where, prefix, copied, top_type)
    rope_theta, partial = _rope(r, text)
    vocab = r.int("vocab_size")
    hidden = r.int("hidden_size")
    num_layers = r.int("num_hidden_layers")
    q_heads, kv_heads = r.int("num_attention_heads"), r.int("num_key_value_heads")
    if q_heads % kv_heads:
        raise r.fail("num_attention_heads", f"({q_heads}) is not a multiple of num_key_value_heads ({kv_heads}): "
                     f"each KV head serves a whole group of query heads; set num_key_value_heads to a divisor of "
                     f"{q_heads}")
    head_dim = r.int("head_dim", None)
    if head_dim is None:
        head_dim = hidden // q_heads
        if head_dim < 1:
            raise r.fail("head_dim", f"is missing and hidden_size // num_attention_heads = {hidden} // {q_heads} = 0; "
                         "set head_dim")
    nk, nv = r.int("linear_num_key_heads"), r.int("linear_num_value_heads")
    if nv % nk:
        raise r.fail("linear_num_value_heads", f"({nv}) is not a multiple of linear_num_key_heads ({nk}): each GDN "
                     f"key head serves a whole group of value heads; set linear_num_key_heads to a divisor of {nv}")
    num_experts = r.int("num_experts")
    top_k = r.int("num_experts_per_tok")
    if top_k > num_experts:
        raise r.fail("num_experts_per_tok", f"({top_k}) is more than num_experts ({num_experts}); it must be in "
                     f"[1, {num_experts}]")
    pattern = _find_pattern(tuple(_layer_types(r, num_layers)))
    if model_type == "qwen3_next":
        if r.of("mlp_only_layers", (list,), "a list", []) or r.int("decoder_sparse_step", 1) != 1:
            raise ConfigError(f"{where}: Qwen3-Next configs with dense (mlp_only) layers are not supported: "
                              "every layer must be MoE (mlp_only_layers [] and decoder_sparse_step 1)")
    eos = eos_ids(text.get("eos_token_id"), vocab, f"{where}: {r.name('eos_token_id')}")
    hf_dtype = r.of("dtype", (str,), "a dtype name such as \"bfloat16\"") or \
        r.of("torch_dtype", (str,), "a dtype name such as \"bfloat16\"") or "bfloat16"
    quant = r.of("quantization_config", (dict,), "an object", {})
    fields = dict(
        name=name or text.get("_name_or_path") or f"hf-{model_type}",
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        layer_pattern=pattern,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        gdn_num_k_heads=nk,
        gdn_num_v_heads=nv,
        gdn_k_head_dim=r.int("linear_key_head_dim"),
        gdn_v_head_dim=r.int("linear_value_head_dim"),
        gdn_conv_kernel=r.int("linear_conv_kernel_dim"),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_ffn=r.int("moe_intermediate_size"),
        shared_ffn=r.int("shared_expert_intermediate_size"),
        norm_topk_prob=r.of("norm_topk_prob", (bool,), "true or false", True),
        rms_norm_eps=r.float("rms_norm_eps", r.raw("rms_norm_eps", 1e-6)),
        max_position_embeddings=r.int("max_position_embeddings", 262144),
        eos_token_ids=eos,
        dtype="float32" if hf_dtype == "float32" else "bfloat16",
    )
    if not isinstance(fields["name"], str):
        raise r.fail("_name_or_path", f"is {_json_type(fields['name'])}; it must be a string")
    if quant:
        block = quant.get("weight_block_size") or [128, 128]
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
            raise r.fail("quantization_config", f"has weight_block_size {_show(block)}; it must be two positive "
                         "integers, e.g. [128, 128]")
        if block[0] != block[1]:
            raise r.fail("quantization_config", f"has weight_block_size {block}, not square; only square blocks are "
                         "supported")
        fields["fp8_block_size"] = block[0]
    fields.update(changes)
    return Config(**fields)


def eos_ids(eos: Any, vocab_size: int, where: str) -> tuple[int, ...]:
    """An HF `eos_token_id` (an int, a list of ints, or null) as a tuple of token ids of the vocabulary;
    `where` names the file and field in errors."""
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            raise ConfigError(f"{where} holds {_show(i)} ({_json_type(i)}); EOS ids must be integer token ids")
        if not 0 <= i < vocab_size:
            raise ConfigError(f"{where} holds {i}, outside the vocabulary [0, {vocab_size}); use the checkpoint's own "
                              "file (the tokenizer and the model disagree)")
    return tuple(ids)


def _find_pattern(layer_types: tuple[str, ...]) -> tuple[str, ...]:
    """The shortest repeating unit of `layer_types` (the decoder scans over repeats of it)."""
    unknown = set(layer_types) - {LINEAR, FULL}
    if unknown or not layer_types:
        raise ConfigError(f"layer types {sorted(unknown)}: expected a non-empty list of {LINEAR!r} or {FULL!r}")
    n = len(layer_types)
    for p in range(1, n + 1):
        if n % p == 0 and layer_types == layer_types[:p] * (n // p):
            return layer_types[:p]
    raise AssertionError("unreachable")
