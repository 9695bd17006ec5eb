"""The groups of a load: which HF tensors fill which leaves of our weight tree, and how (`model_groups` for the main
model, `mtp_groups` for the multi-token-prediction head): groups of leaves filled by ops, each op reading some HF
tensors once and splitting them into pieces of its leaves (the module doc of `qwen35_lib.checkpoint` lists the
forms). `path_infos` names every leaf of a declared tree by its path."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from qwen35_lib.checkpoint.files import scale_name
from qwen35_lib.config import FULL, LINEAR, Config
from qwen35_lib.weights import ArrayInfo, BlockFP8, is_info

Path = tuple[str, ...]  # a leaf's path in the weight tree, e.g. ("layers", "gdn", "w_q")
MTP_PREFIXES = ("mtp.", "model.mtp.")  # the multi-token-prediction head: `load_mtp` reads it
SKIPPED_PREFIXES = ("model.visual.", "visual.", *MTP_PREFIXES)  # what `load_hf_checkpoint` skips: vision tower, MTP


@dataclasses.dataclass(frozen=True)
class Op:
    sources: tuple[str, ...]  # HF tensor names, passed to `split` in this order
    shapes: tuple[tuple[int, ...], ...]  # their shapes as config.json implies
    index: tuple[int, ...]  # where the pieces go in each leaf of the group (leading dims)
    split: Callable[..., dict[str, np.ndarray]]  # source arrays -> {leaf key: piece}
    raw: bool = False  # True: FP8 sources as stored (values and scales), not dequantized
    experts: bool = False  # True: every source's dim 0 is the leaves' dim len(index) (fused experts [E, ...])


@dataclasses.dataclass
class Group:
    leaves: dict[str, Path]  # leaf key (as `split` names it) -> path in the tree
    ops: list[Op] = dataclasses.field(default_factory=list)


class _Groups:
    """Collects ops into groups: `add` for an op filling several leaves, `one` for a single tensor -> leaf."""

    def __init__(self):
        self.groups: dict[tuple[Path, ...], Group] = {}

    def add(self, leaves: dict[str, Path], sources: list[tuple[str, tuple[int, ...]]], index: tuple[int, ...],
            split: Callable[..., dict[str, np.ndarray]], raw: bool = False, experts: bool = False) -> None:
        group = self.groups.setdefault(tuple(leaves.values()), Group(leaves))
        group.ops.append(Op(tuple(n for n, _ in sources), tuple(s for _, s in sources), index, split, raw, experts))

    def one(self, path: Path, name: str, shape: tuple[int, ...], index: tuple[int, ...] = (),
            fn: Callable[[np.ndarray], np.ndarray] = lambda a: a) -> None:
        self.add({"x": path}, [(name, shape)], index, lambda a: {"x": fn(a)})


def _in_heads(w: np.ndarray, n: int, d: int) -> np.ndarray:
    """HF rows [n * d, X] (head-major) -> ours [X, n, d]."""
    return w.reshape(n, d, w.shape[-1]).transpose(2, 0, 1)


def _out_heads(w: np.ndarray, n: int, d: int) -> np.ndarray:
    """HF [D, n * d] (an output projection) -> ours [n, d, D]."""
    return w.reshape(w.shape[0], n, d).transpose(1, 2, 0)


def model_groups(c: Config, prefix: str, tensors: dict, tied: bool) -> list[Group]:
    """Every group of leaves and the ops that fill it.

    1. Top level: embed, final_norm, lm_head (`lm_head.weight`, else the embedding if `tied`).
    2. Per layer i (group g = i // P, slot p = i % P, slot j among layers of its kind): norms and MoE at
       [g, p], then the GDN or attention block at [g, j].
    """
    gs = _Groups()
    D, V = c.hidden_size, c.vocab_size
    embed = prefix + "embed_tokens.weight"
    if "lm_head.weight" in tensors or not tied:
        gs.one(("embed",), embed, (V, D))
        gs.one(("lm_head",), "lm_head.weight", (V, D), fn=lambda a: a.T)
    else:  # tied: one read feeds both leaves
        gs.add({"embed": ("embed",), "lm_head": ("lm_head",)}, [(embed, (V, D))], (),
               lambda a: {"embed": a, "lm_head": a.T})
    gs.one(("final_norm",), prefix + "norm.weight", (D,))
    for i in range(c.num_layers):
        _layer_groups(gs, c, f"{prefix}layers.{i}.", i, tensors)
    return list(gs.groups.values())


def _layer_groups(gs: _Groups, c: Config, pre: str, i: int, tensors: dict) -> None:
    """Decoder layer i of `c` (HF names under `pre`, e.g. "model.layers.3."), into the `layers` leaves: norms and
    MoE at [g, p], the GDN or attention block at [g, j] (g = i // P, p = i % P, j = its index among the layers of
    its kind in the group). The experts' form (fused or per expert) is read per layer."""
    D = c.hidden_size
    kind = c.layer_types[i]
    g, p = divmod(i, len(c.layer_pattern))
    j = c.layer_pattern[:p].count(kind)
    gs.one(("layers", "input_norm"), pre + "input_layernorm.weight", (D,), (g, p))
    gs.one(("layers", "post_norm"), pre + "post_attention_layernorm.weight", (D,), (g, p))
    _moe_groups(gs, c, pre + "mlp.", (g, p), fused=pre + "mlp.experts.gate_up_proj" in tensors)
    if kind == LINEAR:
        _gdn_groups(gs, c, pre + "linear_attn.", (g, j))
    else:
        assert kind == FULL, kind
        _attn_groups(gs, c, pre + "self_attn.", (g, j))


def mtp_groups(c: Config, prefix: str, tensors: dict) -> list[Group]:
    """Every group of the MTP head's leaves (`model.mtp.declare_mtp`) and the ops that fill it: its norms, `fc`
    (HF [D, 2D] on cat([embedding, hidden]) -> ours [2, D, D]: fc[0] the embedding half, fc[1] the hidden half) and
    its one decoder layer, read as layer 0 of a one-layer model (`mtp_layer_config`)."""
    from qwen35_lib.model.mtp import mtp_layer_config

    gs = _Groups()
    D = c.hidden_size
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        gs.one((name,), f"{prefix}{name}.weight", (D,))
    gs.one(("fc",), prefix + "fc.weight", (D, 2 * D), fn=lambda a: a.T.reshape(2, D, D))
    _layer_groups(gs, mtp_layer_config(c), prefix + "layers.0.", 0, tensors)
    return list(gs.groups.values())


def _gdn_groups(gs: _Groups, c: Config, la: str, gj: tuple[int, int]) -> None:
    """One Gated DeltaNet layer (`la` = "...linear_attn.")."""
    D, K = c.hidden_size, c.gdn_conv_kernel
    nk, nv, dk, dv, kd, vd = c.gdn_num_k_heads, c.gdn_num_v_heads, c.gdn_k_head_dim, c.gdn_v_head_dim, \
        c.gdn_key_dim, c.gdn_value_dim
    r = nv // nk  # value heads per key head
    gdn = ("layers", "gdn")
    proj = {n: (*gdn, n) for n in ("w_q", "w_k", "w_v", "w_z", "w_b", "w_a")}
    if c.model_type == "qwen3_next":
        def split_next(qkvz: np.ndarray, ba: np.ndarray) -> dict[str, np.ndarray]:
            # rows grouped by key head: per group [q dk | k dk | v r*dv | z r*dv] and [b r | a r];
            # group h owns value heads h*r .. h*r + r-1, so value rows are head-major after the split
            q, k, v, z = np.split(qkvz.reshape(nk, 2 * dk + 2 * r * dv, D), [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            b, a = np.split(ba.reshape(nk, 2 * r, D), [r], axis=1)
            return dict(w_q=q.transpose(2, 0, 1), w_k=k.transpose(2, 0, 1),  # [D, nk, dk]
                        w_v=_in_heads(v, nv, dv), w_z=_in_heads(z, nv, dv),  # [D, nv, dv]
                        w_b=b.reshape(nv, D).T, w_a=a.reshape(nv, D).T)  # [D, nv]

        gs.add(proj, [(la + "in_proj_qkvz.weight", (2 * kd + 2 * vd, D)), (la + "in_proj_ba.weight", (2 * nv, D))],
               gj, split_next)
    else:
        def split_qkv(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray) -> dict[str, np.ndarray]:
            q, k, v = np.split(qkv, [kd, 2 * kd])  # rows [q | k | v], each head-major
            return dict(w_q=_in_heads(q, nk, dk), w_k=_in_heads(k, nk, dk), w_v=_in_heads(v, nv, dv),
                        w_z=_in_heads(z, nv, dv), w_b=b.T, w_a=a.T)

        gs.add(proj, [(la + "in_proj_qkv.weight", (2 * kd + vd, D)), (la + "in_proj_z.weight", (vd, D)),
                      (la + "in_proj_b.weight", (nv, D)), (la + "in_proj_a.weight", (nv, D))], gj, split_qkv)

    def split_conv(w: np.ndarray) -> dict[str, np.ndarray]:
        q, k, v = np.split(w[:, 0, :], [kd, 2 * kd])  # channels [q | k | v] (both model types), each [ch, K]
        return dict(conv_q=_in_heads(q, nk, dk), conv_k=_in_heads(k, nk, dk), conv_v=_in_heads(v, nv, dv))  # [K, n, d]

    gs.add({n: (*gdn, n) for n in ("conv_q", "conv_k", "conv_v")}, [(la + "conv1d.weight", (2 * kd + vd, 1, K))],
           gj, split_conv)
    gs.one((*gdn, "A_log"), la + "A_log", (nv,), gj)
    gs.one((*gdn, "dt_bias"), la + "dt_bias", (nv,), gj)
    gs.one((*gdn, "norm"), la + "norm.weight", (dv,), gj)
    gs.one((*gdn, "w_out"), la + "out_proj.weight", (D, vd), gj, lambda a: _out_heads(a, nv, dv))


def _attn_groups(gs: _Groups, c: Config, sa: str, gj: tuple[int, int]) -> None:
    """One gated attention layer (`sa` = "...self_attn.")."""
    D, Hq, Hkv, hd = c.hidden_size, c.num_q_heads, c.num_kv_heads, c.head_dim
    attn = ("layers", "attn")

    def split_q(w: np.ndarray) -> dict[str, np.ndarray]:
        qg = w.reshape(Hq, 2, hd, D)  # per head [query hd | gate hd]
        return dict(w_q=qg[:, 0].transpose(2, 0, 1), w_gate=qg[:, 1].transpose(2, 0, 1))  # [D, Hq, hd]

    gs.add({"w_q": (*attn, "w_q"), "w_gate": (*attn, "w_gate")}, [(sa + "q_proj.weight", (Hq * 2 * hd, D))], gj,
           split_q)
    gs.one((*attn, "w_k"), sa + "k_proj.weight", (Hkv * hd, D), gj, lambda a: _in_heads(a, Hkv, hd))
    gs.one((*attn, "w_v"), sa + "v_proj.weight", (Hkv * hd, D), gj, lambda a: _in_heads(a, Hkv, hd))
    gs.one((*attn, "w_o"), sa + "o_proj.weight", (D, Hq * hd), gj, lambda a: _out_heads(a, Hq, hd))
    gs.one((*attn, "q_norm"), sa + "q_norm.weight", (hd,), gj)
    gs.one((*attn, "k_norm"), sa + "k_norm.weight", (hd,), gj)


def _moe_groups(gs: _Groups, c: Config, m: str, gp: tuple[int, int], fused: bool) -> None:
    """One MoE block (`m` = "...mlp."): router, shared expert, routed experts.

    Experts: `w_gate_up [E, D, 2, F]`, `w_down [E, F, D]`. Fused tensors give one op per layer, per-expert tensors
    one op per expert. With `config.expert_dtype` set, values and `scale_inv` tensors are copied as stored into
    `BlockFP8(value, scale)` leaves, the scales transposed like the values.
    """
    D, E, F, Fs, b = c.hidden_size, c.num_experts, c.moe_ffn, c.shared_ffn, c.fp8_block_size
    moe, s, x = ("layers", "moe"), m + "shared_expert.", m + "experts."
    gs.one((*moe, "router"), m + "gate.weight", (E, D), gp, lambda a: a.T)
    gs.one((*moe, "shared_gate"), m + "shared_expert_gate.weight", (1, D), gp, lambda a: a[0])
    gs.add({"x": (*moe, "shared_gate_up")}, [(s + "gate_proj.weight", (Fs, D)), (s + "up_proj.weight", (Fs, D))],
           gp, lambda gw, uw: {"x": np.stack([gw.T, uw.T], axis=1)})  # [D, 2, Fs]
    gs.one((*moe, "shared_down"), s + "down_proj.weight", (D, Fs), gp, lambda a: a.T)

    fp8 = c.expert_dtype is not None
    cd, cf = -(-D // b), -(-F // b)
    gu = {"v": (*moe, "w_gate_up", "value"), "s": (*moe, "w_gate_up", "scale")} if fp8 else {"v": (*moe, "w_gate_up")}
    dn = {"v": (*moe, "w_down", "value"), "s": (*moe, "w_down", "scale")} if fp8 else {"v": (*moe, "w_down")}
    if fused:  # the splits take the expert count from their sources: a sliced load reads only its experts' rows
        gate_up, down = x + "gate_up_proj", x + "down_proj"  # [E, 2F, D] rows [gate | up]; [E, D, F]
        if not fp8:
            gs.add(gu, [(gate_up, (E, 2 * F, D))], gp,
                   lambda a: {"v": a.reshape(-1, 2, F, D).transpose(0, 3, 1, 2)}, experts=True)
            gs.add(dn, [(down, (E, D, F))], gp, lambda a: {"v": a.transpose(0, 2, 1)}, experts=True)
            return
        if F % b:
            raise ValueError(f"fused FP8 experts with moe_intermediate_size {F}, not a multiple of the FP8 block {b}: "
                             "a scale block straddles gate and up; load with fp8='dequantize'")

        def split_gate_up(v: np.ndarray, sc: np.ndarray) -> dict[str, np.ndarray]:
            return {"v": v.reshape(-1, 2, F, D).transpose(0, 3, 1, 2),  # [E, D, 2, F]
                    "s": sc.reshape(-1, 2, cf, cd).transpose(0, 3, 1, 2)}  # [E, cdiv(D, b), 2, cdiv(F, b)]

        gs.add(gu, [(gate_up, (E, 2 * F, D)), (scale_name(gate_up), (E, 2 * cf, cd))], gp, split_gate_up, raw=True,
               experts=True)
        gs.add(dn, [(down, (E, D, F)), (scale_name(down), (E, cd, cf))], gp,
               lambda v, sc: {"v": v.transpose(0, 2, 1), "s": sc.transpose(0, 2, 1)}, raw=True, experts=True)
        return
    for e in range(E):
        gate, up, down = (f"{x}{e}.{n}_proj.weight" for n in ("gate", "up", "down"))  # [F, D], [F, D], [D, F]
        if not fp8:
            gs.add(gu, [(gate, (F, D)), (up, (F, D))], (*gp, e), lambda gw, uw: {"v": np.stack([gw.T, uw.T], axis=1)})
            gs.add(dn, [(down, (D, F))], (*gp, e), lambda a: {"v": a.T})
            continue
        gs.add(gu, [(gate, (F, D)), (up, (F, D)), (scale_name(gate), (cf, cd)), (scale_name(up), (cf, cd))], (*gp, e),
               lambda gv, uv, gs, us: {"v": np.stack([gv.T, uv.T], axis=1), "s": np.stack([gs.T, us.T], axis=1)},
               raw=True)
        gs.add(dn, [(down, (D, F)), (scale_name(down), (cd, cf))], (*gp, e),
               lambda v, sc: {"v": v.T, "s": sc.T}, raw=True)



def path_infos(tree: Any) -> list[tuple[Path, ArrayInfo]]:
    """(path, ArrayInfo) of every leaf, in `jax.tree` order; paths use dict keys and BlockFP8 field names."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_info)
    return [(tuple(_key(k) for k in kp), info) for kp, info in flat]


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            v = getattr(k, attr)
            return BlockFP8._fields[v] if attr == "idx" else str(v)
    raise TypeError(k)

