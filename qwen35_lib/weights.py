"""Every weight of the model, declared once, abstractly.

`declare(config)` returns a pytree of `ArrayInfo` leaves (shape, dtype, logical axes, initializer). The same
tree drives random init (`init_weights`), abstract `ShapeDtypeStruct` trees for ahead-of-time compiles
(`abstract_weights`), checkpoint loading (`qwen35_lib.checkpoint`), the size accounting (`qwen35_lib.stats`)
and, through the logical axes, sharding.

Conventions:
- matrices are stored `[in, ..., out]` so that `y = x @ W` (HF `nn.Linear` weights are `[out, in]`);
- heads are explicit dims (`[D, H, d]`), so a layout can shard by head;
- per-layer weights are stacked `[G, n, ...]`: G = layer groups (the decoder scans over them), n = layers of
  that kind inside one group (e.g. 3 GDN + 1 attention in Qwen3.5; MoE and norms in all 4);
- FP8 expert weights are `BlockFP8(value, scale)` pairs, the scale one float32 per `fp8_block_size` block.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core  # trace_state_clean: is a jit being traced now

from qwen35_lib.config import FULL, Config

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """One declared weight: a pytree leaf (deliberately not a pytree node)."""

    shape: tuple[int, ...]
    dtype: Any
    logical_axes: tuple[str | None, ...]
    init: str  # "normal" (std 0.02), "zeros", "ones", "a_log" (log U[1, 16]), "conv" (U[-1/sqrt(K), 1/sqrt(K)])

    def __post_init__(self):
        assert len(self.shape) == len(self.logical_axes), (self.shape, self.logical_axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * jnp.dtype(self.dtype).itemsize


class BlockFP8(NamedTuple):
    """A block-scaled FP8 tensor: `value` (float8_e4m3fn) * `scale` (float32, one per block) = the weight."""

    value: Any
    scale: Any


def is_info(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


# ---------------------------------------------------------------------------------------------------------------


def declare(config: Config) -> dict:
    """The weight tree of `config`, as `ArrayInfo` leaves."""
    c = config
    dt = jnp.dtype(c.dtype)
    f32 = jnp.float32
    G, P = c.num_groups, len(c.layer_pattern)
    Ng, Na = c.gdn_per_group, c.attn_per_group
    D, E, F, Fs = c.hidden_size, c.num_experts, c.moe_ffn, c.shared_ffn
    nk, nv, dk, dv, K = c.gdn_num_k_heads, c.gdn_num_v_heads, c.gdn_k_head_dim, c.gdn_v_head_dim, c.gdn_conv_kernel
    Hq, Hkv, hd = c.num_q_heads, c.num_kv_heads, c.head_dim

    def stacked(n: int, shape: tuple, axes: tuple, init: str = "normal", dtype=dt) -> ArrayInfo:
        return ArrayInfo((G, n, *shape), dtype, (None, None, *axes), init)

    gdn = dict(
        w_q=stacked(Ng, (D, nk, dk), ("embed", "gdn_k_heads", None)),  # [G, Ng, D, nk, dk]
        w_k=stacked(Ng, (D, nk, dk), ("embed", "gdn_k_heads", None)),
        w_v=stacked(Ng, (D, nv, dv), ("embed", "gdn_v_heads", None)),
        w_z=stacked(Ng, (D, nv, dv), ("embed", "gdn_v_heads", None)),  # output gate
        w_b=stacked(Ng, (D, nv), ("embed", "gdn_v_heads")),  # beta = sigmoid(x @ w_b)
        w_a=stacked(Ng, (D, nv), ("embed", "gdn_v_heads")),  # decay input
        conv_q=stacked(Ng, (K, nk, dk), (None, "gdn_k_heads", None), "conv"),  # causal depthwise conv taps
        conv_k=stacked(Ng, (K, nk, dk), (None, "gdn_k_heads", None), "conv"),
        conv_v=stacked(Ng, (K, nv, dv), (None, "gdn_v_heads", None), "conv"),
        A_log=stacked(Ng, (nv,), ("gdn_v_heads",), "a_log", f32),
        dt_bias=stacked(Ng, (nv,), ("gdn_v_heads",), "ones", f32),
        norm=stacked(Ng, (dv,), (None,), "ones"),  # gated RMSNorm, plain weight
        w_out=stacked(Ng, (nv, dv, D), ("gdn_v_heads", None, "embed")),
    )
    attn = dict(
        w_q=stacked(Na, (D, Hq, hd), ("embed", "q_heads", None)),
        w_gate=stacked(Na, (D, Hq, hd), ("embed", "q_heads", None)),  # sigmoid output gate
        w_k=stacked(Na, (D, Hkv, hd), ("embed", "kv_heads", None)),
        w_v=stacked(Na, (D, Hkv, hd), ("embed", "kv_heads", None)),
        w_o=stacked(Na, (Hq, hd, D), ("q_heads", None, "embed")),
        q_norm=stacked(Na, (hd,), (None,), "zeros"),  # zero-centred
        k_norm=stacked(Na, (hd,), (None,), "zeros"),
    )
    gate_up_axes = ("experts", "embed", None, "moe_ffn")
    down_axes = ("experts", "moe_ffn", "embed")
    if c.expert_dtype is None:
        w_gate_up = stacked(P, (E, D, 2, F), gate_up_axes)  # [G, P, E, D, 2 (gate|up), F]
        w_down = stacked(P, (E, F, D), down_axes)
    else:
        b, fp8 = c.fp8_block_size, jnp.dtype(c.expert_dtype)
        w_gate_up = BlockFP8(stacked(P, (E, D, 2, F), gate_up_axes, dtype=fp8),
                             stacked(P, (E, _cdiv(D, b), 2, _cdiv(F, b)), gate_up_axes, "ones", f32))
        w_down = BlockFP8(stacked(P, (E, F, D), down_axes, dtype=fp8),
                          stacked(P, (E, _cdiv(F, b), _cdiv(D, b)), down_axes, "ones", f32))
    moe = dict(
        router=stacked(P, (D, E), ("embed", None)),
        w_gate_up=w_gate_up,
        w_down=w_down,
        shared_gate_up=stacked(P, (D, 2, Fs), ("embed", None, "ffn")),
        shared_down=stacked(P, (Fs, D), ("ffn", "embed")),
        shared_gate=stacked(P, (D,), ("embed",)),  # sigmoid(x @ shared_gate) scales the shared expert
    )
    layers = dict(
        input_norm=stacked(P, (D,), ("embed",), "zeros"),
        post_norm=stacked(P, (D,), ("embed",), "zeros"),
        moe=moe,
    )
    if Ng:
        layers["gdn"] = gdn
    if Na:
        layers["attn"] = attn
    return dict(
        embed=ArrayInfo((c.vocab_size, D), dt, ("vocab", "embed"), "normal"),
        layers=layers,
        final_norm=ArrayInfo((D,), dt, ("embed",), "zeros"),
        lm_head=ArrayInfo((D, c.vocab_size), dt, ("embed", "vocab"), "normal"),
    )


@functools.lru_cache(maxsize=64)  # the cost model asks once a step shape it prices
def mtp_layer_config(config: Config) -> Config:
    """The MTP head's decoder layer as a model of its own: `config` with one layer, a full-attention one (with its
    MoE: same experts, top-k, shared expert and dtypes as the main layers)."""
    return config.replace(num_layers=1, layer_pattern=(FULL,))


def declare_mtp(config: Config) -> dict:
    """The multi-token-prediction head's weight tree of `config` (`qwen35_lib.model.mtp`), as `ArrayInfo` leaves:
    a tree apart from `declare(config)`'s, so the main model's programs, budgets and counts never include it."""
    dt, D = jnp.dtype(config.dtype), config.hidden_size
    norm = ArrayInfo((D,), dt, ("embed",), "zeros")
    return dict(
        pre_fc_norm_embedding=norm,
        pre_fc_norm_hidden=norm,
        fc=ArrayInfo((2, D, D), dt, (None, "embed", "embed"), "normal"),  # [embedding | hidden, D in, D out]
        layers=declare(mtp_layer_config(config))["layers"],  # leaves [1, 1, ...]
        norm=norm,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def abstract_weights(config: Config, shardings: Any = None) -> Any:
    """`jax.ShapeDtypeStruct` leaves (optionally with shardings): weights for a compile, nothing allocated."""
    decl = declare(config)
    if shardings is None:
        return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), decl, is_leaf=is_info)
    return jax.tree.map(lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s), decl, shardings,
                        is_leaf=is_info)


def _init_leaf(info: ArrayInfo, key: jax.Array) -> jax.Array:
    if info.init == "zeros":
        return jnp.zeros(info.shape, info.dtype)
    if info.init == "ones":
        return jnp.ones(info.shape, info.dtype)
    if info.init == "a_log":
        return jnp.log(jax.random.uniform(key, info.shape, jnp.float32, 1.0, 16.0)).astype(info.dtype)
    if info.init == "conv":
        bound = 1.0 / math.sqrt(info.shape[2])  # kernel taps K sit at dim 2 of [G, n, K, ...]
        return jax.random.uniform(key, info.shape, jnp.float32, -bound, bound).astype(info.dtype)
    assert info.init == "normal", info.init
    return (0.02 * jax.random.normal(key, info.shape, jnp.float32)).astype(info.dtype)


def init_weights(config: Config, key: jax.Array | int = 0) -> dict:
    """Random weights for `config` (HF's initialisation: normal(0.02) matrices, zero-centred norms at 0).

    FP8 expert weights are drawn in float32 and then block-quantized, as a real FP8 checkpoint would be.
    """
    return _init_declared(declare(config), config.fp8_block_size, key)


def init_mtp_weights(config: Config, key: jax.Array | int = 0) -> dict:
    """A random MTP head for `config` (`declare_mtp`'s tree), drawn as `init_weights` draws the main model's."""
    return _init_declared(declare_mtp(config), config.fp8_block_size, key)


def _init_declared(decl: dict, fp8_block_size: int, key: jax.Array | int) -> dict:
    key = jax.random.key(key) if isinstance(key, int) else key
    nodes, treedef = jax.tree.flatten(decl, is_leaf=lambda n: is_info(n) or isinstance(n, BlockFP8))
    # compiled per declaration, not per config: configs differing only in fields the weights do not have (kernels,
    # EOS ids, layouts, chunk sizes) share one program (~4 CPU-s to compile even at qwen3.5-tiny)
    declared = (treedef, tuple(nodes), fp8_block_size)
    # compiler options only on a top-level jit: traced (eval_shape, inside a jit) the draw is part of the caller's
    return (_init_jit_top if jax_core.trace_state_clean() else _init_jit)(declared, key)


# Under XLA:CPU at -O0 ($XLA_FLAGS, the tests' and notebooks' FAST_COMPILE) the draw alone compiles at -O1: at -O0
# qwen3.5-mini's 115M normals took ~14 CPU-s to draw instead of ~2, for the same compile time. -O1 draws the default
# level's bits (-O0's differ in the last place), so the weights are those of a run without the flag.
_INIT_OPTIONS = {"xla_backend_optimization_level": 1} if "--xla_backend_optimization_level=0" in \
    os.environ.get("XLA_FLAGS", "") else None


def _init_draw(declared: tuple, key: jax.Array) -> dict:
    treedef, nodes, block = declared  # (tree structure, ArrayInfo | BlockFP8 leaves, fp8 block size)
    keys = jax.random.split(key, len(nodes))

    def init(node, k):
        if isinstance(node, BlockFP8):  # draw in float32, then quantize as an FP8 checkpoint would be
            dense = _init_leaf(dataclasses.replace(node.value, dtype=jnp.float32), k)
            return quantize_fp8(dense, block, fp8_block_dims(node.value.shape, node.scale.shape))
        return _init_leaf(node, k)

    return treedef.unflatten([init(n, k) for n, k in zip(nodes, keys)])


_init_jit = jax.jit(_init_draw, static_argnums=0)
_init_jit_top = jax.jit(_init_draw, static_argnums=0, compiler_options=_INIT_OPTIONS)


# ---------------------------------------------------------------------------------------------------------------
# Block-scaled FP8 (e4m3): the DeepSeek-V3 / Qwen FP8 checkpoint format, `w = q * scale` per square block.
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def fp8_block_dims(value_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The blocked dims of an FP8 tensor: those where the scale is smaller than the value."""
    return tuple(d for d, (v, s) in enumerate(zip(value_shape, scale_shape)) if v != s)


def quantize_fp8(w: jax.Array, block: int, dims: tuple[int, ...]) -> BlockFP8:
    """Quantize `w` to FP8 with one float32 scale per `block` x `block` tile over `dims` (others unblocked)."""
    pads = [(0, 0)] * w.ndim
    for d in dims:
        pads[d] = (0, _cdiv(w.shape[d], block) * block - w.shape[d])
    wp = jnp.pad(w.astype(jnp.float32), pads)
    split = []  # each blocked dim n -> (n // block, block)
    for d, n in enumerate(wp.shape):
        split += [n // block, block] if d in dims else [n]
    tiles = wp.reshape(split)
    block_axes = tuple(d + 1 + sum(1 for dd in dims if dd < d) for d in dims)
    amax = jnp.max(jnp.abs(tiles), axis=block_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)  # [.., nb, 1, .., nb, 1]
    q = (tiles / scale).astype(jnp.float8_e4m3fn).reshape(wp.shape)
    q = q[tuple(slice(0, n) for n in w.shape)]
    return BlockFP8(q, jnp.squeeze(scale, block_axes))


def dequantize_fp8(w: BlockFP8, block: int, dtype: Any) -> jax.Array:
    """The dense weight of a `BlockFP8`: the FP8 values times each block's scale, in `dtype`.

    The minor dimension's scale is repeated over its blocks (a copy 1/block the weight's size when a major
    dimension is blocked too); every other blocked dimension is split into [blocks, block] and its scale
    broadcast over the block. Repeating every dimension's scale (the NumPy twin's way) made XLA:TPU write a float32
    scale per element: one 64-expert MoE layer of the 397B at 512 tokens read and wrote 23.6 GB by the compile's
    cost analysis, 16.7 GB this way (issue 30). A ragged last block is repeated too."""
    value, scale = w.value, w.scale
    split, sshape = [], []
    for d, n in enumerate(value.shape):
        if scale.shape[d] != n and (d == value.ndim - 1 or n % block):
            scale = jnp.repeat(scale, block, axis=d)[(slice(None),) * d + (slice(0, n),)]
        if scale.shape[d] == n:
            split.append(n)
            sshape.append(n)
        else:
            split += [n // block, block]
            sshape += [n // block, 1]
    dense = value.reshape(split).astype(jnp.float32) * scale.reshape(sshape).astype(jnp.float32)
    return dense.reshape(value.shape).astype(dtype)


def dequantize_fp8_np(value: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """NumPy twin of `dequantize_fp8` for loading (float32 result)."""
    for d in range(scale.ndim):
        if scale.shape[d] != value.shape[d]:
            scale = np.repeat(scale, block, axis=d)[(slice(None),) * d + (slice(0, value.shape[d]),)]
    return value.astype(np.float32) * scale.astype(np.float32)
