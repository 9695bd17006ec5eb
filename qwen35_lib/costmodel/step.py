"""The step-time model: one mixed step (prefill chunks + decodes) under a stage, per device, by component.

`step_time(cfg, specs, stage, batch)`:
1. resolve the stage's layout on the system's devices (`stages.resolve_layout`) into a `Placement`;
2. per layer type, the op costs of `ops` (attention or GDN mixer, norms, MoE), each turned into seconds by its
   roofline on one device, times the number of layers of that type;
3. the collectives the layout and routing need, per layer (`collectives`), on the system's topology;
4. embedding and LM head once per step;
5. step seconds = the sum (no overlap of compute and collectives, except inside the hierarchical
   reduce-scatter): the slowest device is any device, since ranks are balanced.
`ideal=True` gives the roofline bound: the same work with every weight and token spread over all devices, every
weight read once, only the experts hit read, efficiencies 1, no collectives, no launch overheads.
"""

from __future__ import annotations

import dataclasses
import math

from qwen35_lib.config import Config
from qwen35_lib.costmodel import collectives as cc
from qwen35_lib.costmodel import ops
from qwen35_lib.costmodel.specs import Specs, kernel_facts
from qwen35_lib.costmodel.stages import Stage, resolve_layout
from qwen35_lib.kernels.registry import family_kernels

COMPONENTS = ("attn_proj", "attn_core", "gdn_proj", "gdn_core", "router", "shared_expert", "routed_experts",
              "permute", "norms", "embed_lm_head", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
COMM = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclasses.dataclass(frozen=True)
class StepTime:
    seconds: float
    breakdown: dict[str, float]  # component -> seconds (sums to `seconds`)
    flops: float  # per device
    hbm_bytes: float  # per device
    wire_bytes: float  # per device, sent over links

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def placement(cfg: Config, specs: Specs, stage: Stage, kv_dtype: str | None = None, page_size: int = 256,
              ideal: bool = False) -> ops.Placement:
    """The `ops.Placement` of a stage on a system (kernel families resolved for its kind)."""
    if ideal:
        return ops.Placement(dp=specs.devices, tp=1, moe="ep", ep=specs.devices, attention="pallas", moe_impl="gmm",
                             kv_dtype=kv_dtype, page_size=page_size, static_buffers=False)
    lay = resolve_layout(stage, cfg, specs.devices)
    facts = kernel_facts()
    kernels = family_kernels(stage.kernels, specs.kind)  # the table the code reads
    attention, moe_impl = kernels["attention_kernel"], kernels["moe_kernel"]
    moe_impl = "gmm" if moe_impl == "pallas" else moe_impl  # the Pallas grouped matmul (`ops` names it gmm)
    passes = facts[f"{stage.kernels}_weight_passes"]["value"]
    return ops.Placement(dp=lay.dp, tp=lay.tp, moe=lay.moe, ep=lay.ep,
                         attention=attention, moe_impl=moe_impl, kv_dtype=kv_dtype, page_size=page_size,
                         weight_passes=passes)


def _ideal_specs(s: Specs) -> Specs:
    return s.replace(eff_matmul=1.0, eff_hbm=1.0, op_overhead_s=0.0)


def step_time(cfg: Config, specs: Specs, stage: Stage, batch: ops.Batch, kv_dtype: str | None = None,
              page_size: int = 256, ideal: bool = False, overlap: bool = True) -> StepTime:
    """Seconds of one step of `batch` under `stage` on `specs` (see the module doc)."""
    pl = placement(cfg, specs, stage, kv_dtype, page_size, ideal)
    s = _ideal_specs(specs) if ideal else specs
    z = ops.sizes(cfg)
    out = dict.fromkeys(COMPONENTS, 0.0)
    flops = hbm = 0.0

    def add(costs: dict[str, ops.Cost], times: float) -> None:
        nonlocal flops, hbm
        for name, c in costs.items():
            out[name] += ops.seconds(c, s) * times
            flops += c.flops * times
            hbm += c.hbm_bytes * times

    if ideal:  # every byte of dense weights once over the slice, not once per data-parallel rank
        dense = ops.Placement(dp=specs.devices, tp=specs.devices, moe="ep", ep=specs.devices, attention="pallas",
                              moe_impl="gmm", kv_dtype=kv_dtype, page_size=page_size, static_buffers=False)
        attn = ops.attention_block(cfg, batch, pl)
        attn["attn_proj"] = ops.attention_block(cfg, batch, dense)["attn_proj"]
        gdn = ops.gdn_block(cfg, batch, pl)
        gdn["gdn_proj"] = ops.gdn_block(cfg, batch, dense)["gdn_proj"]
        moe = ops.moe_block(cfg, batch, pl)
        moe["shared_expert"] = ops.moe_block(cfg, batch, dense)["shared_expert"]
        moe["router"] = ops.moe_block(cfg, batch, dense)["router"]
        head = ops.embed_and_head(cfg, batch, dense)
    else:
        attn, gdn = ops.attention_block(cfg, batch, pl), ops.gdn_block(cfg, batch, pl)
        moe, head = ops.moe_block(cfg, batch, pl), ops.embed_and_head(cfg, batch, pl)
    add(attn, z["n_attn"])
    add(gdn, z["n_gdn"])
    add(moe, cfg.num_layers)
    add({"norms": ops.norms(cfg, batch, pl)}, cfg.num_layers)
    add({"embed_lm_head": head}, 1)

    wire = 0.0
    if not ideal:
        for name, comm in layer_collectives(cfg, specs, stage, pl, batch, overlap).items():
            out[name] += comm.seconds * cfg.num_layers
            wire += comm.wire_bytes * cfg.num_layers
    return StepTime(sum(out.values()), out, flops, hbm, wire)


def expected_a2a_rows(cfg: Config, tokens: float, ep: int) -> float:
    """Rows `tokens` tokens need under deduplicated all-to-all over ep devices (E/ep experts each), uniform
    routing: tokens · ep · (1 - C(E - E/ep, k) / C(E, k)), the expected distinct devices of a token's k experts."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    miss = math.comb(E - E // ep, k) / math.comb(E, k)
    return tokens * ep * (1 - miss)


def layer_collectives(cfg: Config, specs: Specs, stage: Stage, pl: ops.Placement, batch: ops.Batch,
                      overlap: bool = True) -> dict[str, cc.Comm]:
    """The collectives of one layer (mixer + MoE) per device, by kind (several of a kind are summed).

    - TP (`tp8_kvrep`): all-reduce of [T, D] after the mixer and after the MoE;
    - EP + all_to_all, as `parallel.routing` sends it (dropless, deduplicated): each token at most once per
      destination device, in a static buffer of T_dev rows per destination (`routing.a2a_cap`: any destination
      may get every token) that XLA's dense all-to-all moves whole: dispatch n·T_dev rows of D plus the packed
      local ids and weights (2k int32 per row), combine n·T_dev rows of D. The rows a token really needs
      (`expected_a2a_rows`: its distinct destination devices) are fewer; only a ragged all-to-all would move
      just those (XLA:CPU has none);
    - EP + replicate: all-gather of the hidden states [T_dev, D], of the top-k ids [T_dev, k] int32 and of the
      weights [T_dev, k] (float32, as tpu-inference bitcasts them) -- or one packed all-gather of both with
      `fuse_allgather` -- then a reduce-scatter of the [T, D] partial sums (hierarchical with micro-batches when
      `hierarchical_rs`).
    """
    n, act = specs.devices, ops.sizes(cfg)["act"]
    D, k = cfg.hidden_size, cfg.num_experts_per_tok
    T = batch.computed
    zero = cc.Comm(0.0, 0.0)
    out = {name: zero for name in COMM}
    if n == 1:
        return out
    if pl.moe == "tp":
        ar = cc.all_reduce(specs, T * D * act, n)
        out["all_reduce"] = cc.Comm(2 * ar.seconds, 2 * ar.wire_bytes)
        return out
    T_dev = T / pl.dp
    if stage.routing == "all_to_all":
        rows = n * T_dev  # the static buffer: T_dev rows for each of the n destinations
        parts = [cc.all_to_all(specs, rows * (D * act + 2 * k * 4), n), cc.all_to_all(specs, rows * D * act, n)]
        out["all_to_all"] = cc.Comm(sum(p.seconds for p in parts), sum(p.wire_bytes for p in parts))
        return out
    parts = [cc.all_gather(specs, T_dev * D * act, n)]
    parts += [cc.all_gather(specs, T_dev * k * 8, n)] if stage.fuse_allgather else \
        [cc.all_gather(specs, T_dev * k * 4, n), cc.all_gather(specs, T_dev * k * 4, n)]
    out["all_gather"] = cc.Comm(sum(p.seconds for p in parts), sum(p.wire_bytes for p in parts))
    rs_bytes = T * D * act
    out["reduce_scatter"] = cc.hierarchical_reduce_scatter(specs, rs_bytes, stage.rs_slices(T), overlap) \
        if stage.hierarchical_rs else cc.reduce_scatter(specs, rs_bytes, n)
    return out
