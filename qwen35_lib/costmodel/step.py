"""The step-time model: one mixed step (prefill chunks + decodes) under a stage, per device, by component.

`step_time(cfg, specs, stage, batch)`:
1. the stage bound to the system's devices (`bind_to`: `predict` binds once and hands the bound plan down) as an
   `ops.Pricing` (`pricing`);
2. per layer type, the op costs of `ops` (attention or GDN mixer, norms, MoE), each turned into seconds by its
   roofline on one device, times the number of layers of that type;
3. the collectives of the whole step (`traffic.step_collectives`: per layer, embedding, logits, sampling), each
   priced on the system's topology (`collectives`);
4. embedding and LM head once per step;
5. step seconds = the sum (no overlap of compute and collectives, except inside the hierarchical
   reduce-scatter): the slowest device is any device, since ranks are balanced.
With `mech` (`assumptions.Mechanisms`), the serving mechanisms of data/costmodel_assumptions.json change it: the
efficiencies, expert imbalance and grouped-matmul tiles in the op costs, the attention kernel's efficiency and its
mixed-step slowdown, the permute's SparseCore share, the FP8 hidden all-gather, a fraction of the collectives hidden
behind compute, and a host time per step (component `host`). `mech=None` is the model without them.
`ideal=True` gives the roofline bound: the same work with every weight and token spread over all devices, every
weight read once, only the experts hit read, efficiencies 1, no collectives, no launch overheads.
A step timed here is re-priced under mechanisms that only rescale its components by `retime` (a band's ends).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence

import numpy as np

from qwen35_lib.config import Config
from qwen35_lib.costmodel import collectives as cc
from qwen35_lib.costmodel import fused_combine, moe_costs, mtp_costs, ops, traffic
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.specs import Specs, kernel_facts
from qwen35_lib.costmodel.temporaries import IN_PLACE_MOE
from qwen35_lib.model.layer_loop import unrolled
from qwen35_lib.plan import BoundPlan, ServingPlan, abstract_mesh
from qwen35_lib.weights import mtp_layer_config

COMPONENTS = ("attn_proj", "attn_core", "gdn_proj", "gdn_core", "gdn_conv", "cache_copies", "router", "shared_expert",
              "routed_experts", "expert_scales", "permute", "onehot_permute", "moe_rows", "norms", "embed_lm_head",
              "sampling", "glue", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "host")
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


# plans another engine runs (tpu-inference: a cache array per layer, updated in place, no layer scan, its MoE layer's
# SparseCore permutes); every stage of the ladder and every corner of the 2 x 2 (`google_baseline` included: the TP
# layout with this engine's Pallas kernels on each device's heads, `parallel.ranks`) is priced as this engine
OTHER_ENGINE = frozenset({"tpu_inference_3050"})


@dataclasses.dataclass(frozen=True)
class Pools:
    """The cache pools the engine allocates on one device, per layer (bytes): what an engine that copies each layer's
    pool a step copies (`kernels.engine_cache_copy_passes`: 0 for this engine's layer rows, measured)."""

    kv: float = 0.0  # one attention layer's KV pool (FP8 scales included)
    gdn: float = 0.0  # one GDN layer's state and conv pool


@functools.lru_cache(maxsize=1024)
def bind_to(stage: ServingPlan | BoundPlan, cfg: Config, specs: Specs, kv_dtype: str | None = None) -> BoundPlan:
    """`stage` bound to the system's devices (`on_devices`, then `bound` to the abstract mesh of that many devices:
    the engine's own check of the model there, the kernels for the system's kind, `kv_dtype` where the plan names
    none); a plan bound there already (as `predict` hands it down) is returned as it is."""
    return stage.on_devices(specs.devices).bound(abstract_mesh(specs.devices), cfg, platform=specs.kind,
                                                 kv_dtype=kv_dtype)


def expert_weight_passes(plan: BoundPlan) -> float:
    """Passes over the routed experts' weight bytes the bound `plan`'s MoE kernel makes on the layer scan, by its
    implementation (data/costmodel_hardware.json 'kernels'): a kernel that reads the stacks in place
    (`temporaries.IN_PLACE_MOE`: the Pallas grouped matmul) once, XLA's (`ragged_dot`, `native`, ...) as its dots
    read the scan's sliced inputs."""
    reads = "pallas" if plan.kernel("moe_matmul") in IN_PLACE_MOE else "xla"
    return kernel_facts()[f"{reads}_weight_passes"]["value"]


@functools.lru_cache(maxsize=1024)  # once per (stage, system), not per simulated step
def pricing(cfg: Config, specs: Specs, stage: ServingPlan, kv_dtype: str | None = None, page_size: int = 256,
              ideal: bool = False, expert_imbalance: float = 1.0, gmm_tile_rows: int = 0, onehot_threshold: int = 0,
              row_overhead_s: float = 0.0, pools: Pools | None = None, layer_fixed_s: float = 0.0) -> ops.Pricing:
    """The `ops.Pricing` of a stage on a system (bound there: each slot's implementation for its kind, priced by
    the facts of that implementation); `pools`: the engine's cache pools (None: no copies charged)."""
    if ideal:
        return ops.Pricing(dp=specs.devices, tp=1, moe="ep", ep=specs.devices, attention="pallas", moe_impl="pallas",
                             kv_dtype=kv_dtype, page_size=page_size, static_buffers=False)
    lay = bind_to(stage, cfg, specs)
    facts = kernel_facts()
    attention, moe_impl, gdn = lay.kernel("attention"), lay.kernel("moe_matmul"), lay.kernel("gdn")
    expert_passes = expert_weight_passes(lay)
    # the dense projections: the plan's `dense` kernel on the layer scan (XLA's dots on the scan's sliced inputs;
    # the Pallas projection reads the stacks in place, `kernels.dense.pallas`), each measured off its compile;
    # another engine's unscanned layers, and this engine's unrolled loop (`layer_loop.unrolled`: per-layer weights
    # and caches), are read in place
    in_place = unrolled(cfg, lay)
    scan = facts["pallas_dense_weight_passes" if lay.kernel("dense") == "pallas" else "xla_weight_passes"]["value"]
    passes = expert_passes if stage.name in OTHER_ENGINE else 1.0 if in_place else scan
    # the router stays XLA's dot on the scan's slice where the Pallas projection reads the other stacks in place
    router = facts["pallas_router_passes"]["value"] if lay.kernel("dense") == "pallas" and passes == scan \
        else None
    fp8_xla = moe_impl in ("ragged_dot", "capacity") and specs.kind == "tpu" and cfg.expert_dtype == "float8_e4m3fn"
    ours = pools is not None and stage.name not in OTHER_ENGINE and not in_place
    production = stage.name in OTHER_ENGINE  # tpu-inference's MoE layer around the grouped matmul
    gdn_xla = gdn == "xla" and specs.kind == "tpu"
    xla_fp8_kv = attention in ("xla", "items") and specs.kind == "tpu" and kv_dtype == "float8_e4m3fn"
    # this engine's Pallas step on the TPU: the XLA ops around its kernels, as its compile moves them (`ops.glue`);
    # the hierarchical reduce-scatter's micro-batch slices wherever this engine's plan has it, XLA's kernels or not
    # (the change of that collective step: the XLA hier_rs stage's texts hold the same slices)
    parts = (("gdn", "gdn", "gdn"), ("attn", "attention", "attention"), ("stream", "stream", "dense"))
    ours_tpu = not production and specs.kind == "tpu"
    glue = {f"{part}_glue_passes": facts[f"pallas_{name}_glue_passes"]["value"] for part, name, slot in parts
            if lay.kernel(slot) == "pallas"} if ours_tpu else {}
    if ours_tpu and stage.hierarchical_rs:
        glue["hier_rs_glue_passes"] = facts["pallas_hier_rs_glue_passes"]["value"]
    if stage.fused_combine and specs.kind == "tpu":
        glue["gathered_relayouts"] = fused_combine.GATHERED_RELAYOUTS
    sums = moe_costs.SCOPED_VMEM_BYTES if moe_impl == "pallas" and ours_tpu and not stage.fused_combine else 0.0
    rates = dict(dense_row_efficiency=specs.dense_row_efficiency)  # the CPU's measured few-rows dots
    return ops.Pricing(**glue, **rates, combine_sum_hbm_bytes=sums, dp=lay.dp, tp=lay.tp, moe=lay.moe, ep=lay.ep,
                         attention=attention, moe_impl=moe_impl, kv_dtype=kv_dtype, page_size=page_size,
                         weight_passes=passes, router_passes=router, expert_passes=expert_passes,
                         expert_imbalance=expert_imbalance,
                         gmm_tile_rows=gmm_tile_rows if moe_impl == "pallas" else 0,
                         onehot_threshold=onehot_threshold if production else 0,
                         row_overhead_s=row_overhead_s if production else 0.0, production_moe=production,
                         layer_fixed_s=layer_fixed_s if production else 0.0,
                         permute_passes=2.0 if production else fused_combine.permute_passes(cfg, lay.ep)
                         if stage.fused_combine else facts["kernels_moe_permute_passes"]["value"],
                         expert_bytes_per_param=facts["xla_tpu_fp8_expert_bytes_tp" if lay.moe == "tp" else
                                                      "xla_tpu_fp8_expert_bytes"]["value"] if fp8_xla else 0.0,
                         cache_copy_passes=facts["engine_cache_copy_passes"]["value"] if ours else 0.0,
                         kv_pool_bytes=pools.kv if pools else 0.0, gdn_pool_bytes=pools.gdn if pools else 0.0,
                         gdn_state_passes=facts["xla_tpu_gdn_state_passes"]["value"] if gdn_xla else 2.0,
                         sampling_passes=facts["sampling_logit_passes"]["value"] if specs.kind == "tpu" else 0.0,
                         gdn_prefill="recurrent" if gdn == "native" else "chunked",
                         kv_read_bytes=facts["xla_tpu_paged_attention_bytes"]["value"] if xla_fp8_kv else 0.0,
                         items_read_bytes=facts["xla_tpu_items_attention_bytes"]["value"] if xla_fp8_kv else 0.0)


def _ideal_specs(s: Specs) -> Specs:
    return s.replace(eff_matmul=1.0, eff_hbm=1.0, op_overhead_s=0.0)


@functools.lru_cache(maxsize=256)
def mech_specs(specs: Specs, mech: Mechanisms | None) -> Specs:
    """The specs with the efficiencies `mech` sets (None: unchanged)."""
    if mech is None:
        return specs
    ch = {k: v for k, v in (("eff_matmul", mech.matmul_efficiency), ("eff_hbm", mech.hbm_efficiency),
                            ("eff_ici", mech.ici_efficiency)) if v is not None}
    return specs.replace(**ch) if ch else specs


def _mech_pricing(cfg: Config, specs: Specs, stage: ServingPlan, kv_dtype: str | None, page_size: int,
                    ideal: bool, mech: Mechanisms | None, pools: Pools | None = None) -> tuple[Specs, ops.Pricing]:
    """The specs with `mech`'s efficiencies, and the stage's pricing with its MoE mechanisms."""
    specs = mech_specs(specs, mech)
    return specs, pricing(cfg, specs, stage, kv_dtype, page_size, ideal, *(
        (mech.expert_imbalance, mech.gmm_tile_rows, mech.onehot_permute_threshold, mech.moe_row_overhead_s)
        if mech else (1.0, 0, 0, 0.0)), pools=pools, layer_fixed_s=mech.moe_layer_fixed_s if mech else 0.0)


def step_costs(cfg: Config, specs: Specs, stage: ServingPlan, batch: ops.Batch, kv_dtype: str | None = None,
               page_size: int = 256, ideal: bool = False, mech: Mechanisms | None = None,
               weight_passes: float | None = None, pools: Pools | None = None) -> dict[str, ops.Cost]:
    """{component: the `ops.Cost` of the whole step on one device} (every layer of its kind summed): the work
    `step_time` prices, without collectives or host time (`compiled` sets its bytes and FLOPs beside a compile's;
    `weight_passes` replaces the kernel family's, e.g. 1 for a program without a layer scan; `pools`: the engine's
    cache pools, whose copies the engine's layer scan pays)."""
    if ideal:
        mech = None
    specs, pr = _mech_pricing(cfg, specs, stage, kv_dtype, page_size, ideal, mech, pools)
    if weight_passes is not None:
        pr = dataclasses.replace(pr, weight_passes=weight_passes)
    return _costs(cfg, specs.devices, pr, batch, kv_dtype, page_size, ideal)


def _costs(cfg: Config, devices: int, pr: ops.Pricing, batch: ops.Batch, kv_dtype: str | None, page_size: int,
           ideal: bool) -> dict[str, ops.Cost]:
    """`step_costs` on the pricing already resolved (`devices`: the system's): the attention layers here (their
    core reads the contexts), the rest by the step's token counts (`_by_counts`)."""
    z = ops.sizes(cfg)
    dense = _dense(devices, kv_dtype, page_size) if ideal else None
    attn = ops.attention_block(cfg, batch, pr)
    if dense is not None:
        attn["attn_proj"] = ops.attention_block(cfg, batch, dense)["attn_proj"]
    out = {name: c * z["n_attn"] for name, c in attn.items()}
    for name, c in _by_counts(cfg, pr, batch.counts(), dense).items():
        out[name] = out[name] + c if name in out else c
    for name, c in mtp_costs.mtp_head(cfg, batch, pr).items():  # speculative decoding: the head's draft step
        out[name] = out[name] + c if name in out else c
    return out


def _dense(devices: int, kv_dtype: str | None, page_size: int) -> ops.Pricing:
    """The ideal roofline's pricing of the dense weights: every byte once over the slice, not once per
    data-parallel rank."""
    return ops.Pricing(dp=devices, tp=devices, moe="ep", ep=devices, attention="pallas", moe_impl="pallas",
                         kv_dtype=kv_dtype, page_size=page_size, static_buffers=False)


@functools.lru_cache(maxsize=4096)  # a schedule's steps differ mostly in their contexts: ~6x fewer token counts
def _by_counts(cfg: Config, pr: ops.Pricing, batch: ops.Batch, dense: ops.Pricing | None) -> dict[str, ops.Cost]:
    """`step_costs` of every layer but the attention layers (GDN, MoE, norms, embedding and LM head), which read
    `batch`'s token and sequence counts, not its contexts; `dense`: the ideal roofline's pricing of the dense
    weights (None: `pr`'s)."""
    z = ops.sizes(cfg)
    gdn, moe = ops.gdn_block(cfg, batch, pr), moe_costs.moe_block(cfg, batch, pr)
    head = ops.embed_and_head(cfg, batch, dense or pr)
    if dense is not None:
        gdn["gdn_proj"] = ops.gdn_block(cfg, batch, dense)["gdn_proj"]
        moe["shared_expert"] = moe_costs.moe_block(cfg, batch, dense)["shared_expert"]
        moe["router"] = moe_costs.moe_block(cfg, batch, dense)["router"]
    out: dict[str, ops.Cost] = {}
    norms, L = {"norms": ops.norms(cfg, batch, pr)}, cfg.num_layers
    once = {"embed_lm_head": head, "sampling": ops.sampling(cfg, batch, pr), "glue": ops.glue(cfg, batch, pr)}
    for costs, times in ((gdn, z["n_gdn"]), (moe, L), (norms, L), (once, 1)):
        for name, c in costs.items():
            out[name] = out[name] + c * times if name in out else c * times
    return out


def step_time(cfg: Config, specs: Specs, stage: ServingPlan, batch: ops.Batch, kv_dtype: str | None = None,
              page_size: int = 256, ideal: bool = False, overlap: bool = True,
              mech: Mechanisms | None = None, pools: Pools | None = None) -> StepTime:
    """Seconds of one step of `batch` under `stage` on `specs` (see the module doc); `pools`: the engine's cache
    pools on one device (`Pools`; None: their copies are not charged)."""
    if ideal:
        mech = None
    specs, pr = _mech_pricing(cfg, specs, stage, kv_dtype, page_size, ideal, mech, pools)
    costs = _costs(cfg, specs.devices, pr, batch, kv_dtype, page_size, ideal)
    s = _ideal_specs(specs) if ideal else specs
    out = dict.fromkeys(COMPONENTS, 0.0)
    for name, c in costs.items():
        out[name] += ops.seconds(c, s)
    flops = sum(c.flops for c in costs.values())
    hbm = sum(c.hbm_bytes for c in costs.values())

    wire = 0.0
    if not ideal:
        hidden = 1.0 - (mech.collective_overlap if mech else 0.0)
        fp8 = bool(mech and mech.fp8_allgather)
        for name, comm in step_comms(cfg, specs, stage, batch, overlap, fp8_allgather=fp8).items():
            out[name] += comm.seconds * hidden
            wire += comm.wire_bytes
        if stage.fused_combine:  # the combine's remote DMAs, behind the grouped matmul (`fused_combine`)
            c = fused_combine.combine_comm(cfg, specs, batch.computed)
            out["all_to_all"] += fused_combine.exposed(c.seconds, out["routed_experts"], mech)
            wire += c.wire_bytes
    if mech is not None:
        _mechanism_rules(out, cfg, s, pr, batch, mech)
    return StepTime(sum(out.values()), out, flops, hbm, wire)


def _mechanism_rules(out: dict, cfg: Config, s: Specs, pr: ops.Pricing, batch: ops.Batch | Steps,
                     mech: Mechanisms) -> None:
    """`mech`'s rules on the seconds of `out` ({component: seconds}, or [n] arrays of n steps with `Steps`), in
    place (new values, never arrays changed in place)."""
    if mech.attention_kernel_efficiency:
        out["attn_core"] = out["attn_core"] * (s.eff_hbm / mech.attention_kernel_efficiency)
    mixed = (batch.decodes != 0) & (batch.prefill_tokens != 0)
    out["attn_core"] = where(mixed, out["attn_core"] * mech.mixed_step_attention, out["attn_core"])
    if pr.moe_impl == "pallas" and pr.production_moe:  # production's SparseCore gathers (`moe_layer`); XLA's permutes,
        # and the one-hot matmuls below the threshold, stay on the TensorCore
        big = batch.computed * cfg.num_experts_per_tok > mech.onehot_permute_threshold
        out["permute"] = where(big, out["permute"] * mech.sparsecore_permute, out["permute"])
    out["host"] = out["host"] + (mech.host_step_overhead_s if mech.async_scheduling else mech.host_step_time_sync_s)


def where(cond, x, y):
    """x where `cond` holds, else y: `cond` a bool (one step) or a bool array [n] (n steps)."""
    return np.where(cond, x, y) if isinstance(cond, np.ndarray) else x if cond else y


@dataclasses.dataclass(frozen=True)
class Steps:
    """The fields of n batches that the mechanism rules read, as [n] arrays."""

    decodes: np.ndarray
    prefill_tokens: np.ndarray
    computed: np.ndarray

    @staticmethod
    @functools.lru_cache(maxsize=8)  # a band asks it of the same schedule for every mechanism
    def of(batches: tuple[ops.Batch, ...]) -> Steps:
        return Steps(*np.array([(b.decodes, b.prefill_tokens, b.computed) for b in batches],
                                dtype=np.int64).reshape(-1, 3).T)


_COST_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(ops.Cost)))


def _stacked(each: list[dict[str, ops.Cost]]) -> dict[str, ops.Cost]:
    """n {component: Cost} as {component: a `Cost` of [n] arrays} (0 where one lacks the component)."""
    names = list(dict.fromkeys(name for costs in each for name in costs))
    zero = ops.Cost()
    rows = np.array([[_COST_FIELDS(c.get(name, zero)) for name in names] for c in each], dtype=np.float64)
    rows = rows.reshape(len(each), len(names), -1)  # [n, components, Cost fields]
    return {name: ops.Cost(*rows[:, i].T) for i, name in enumerate(names)}


@functools.lru_cache(maxsize=8)  # a band re-times one schedule under a few pricings (8 x ~3 MB at 4k steps)
def _cost_table(cfg: Config, devices: int, pr: ops.Pricing, batches: tuple[ops.Batch, ...], kv_dtype: str | None,
                page_size: int, ideal: bool) -> dict[str, ops.Cost]:
    """`_costs` of every batch at once, as {component: a `Cost` of [n] arrays}, in `_costs`' order of operations:
    the attention layers' (`_attention_table`, shared by pricings that differ in their MoE only) plus the rest,
    per distinct token counts (`_by_counts`)."""
    z = ops.sizes(cfg)
    dense = _dense(devices, kv_dtype, page_size) if ideal else None
    moe_free = dataclasses.replace(pr, expert_imbalance=1.0, gmm_tile_rows=0, onehot_threshold=0, row_overhead_s=0.0,
                                   layer_fixed_s=0.0)
    out = {name: c * z["n_attn"] for name, c in _attention_table(cfg, moe_free, dense, batches).items()}
    index: dict[ops.Batch, int] = {}
    at = np.array([index.setdefault(b.counts(), len(index)) for b in batches], dtype=np.int64)  # [n]
    for name, c in _stacked([_by_counts(cfg, pr, counts, dense) for counts in index]).items():
        c = ops.Cost(*(v[at] for v in _COST_FIELDS(c)))
        out[name] = out[name] + c if name in out else c
    if any(b.drafts for b in batches):  # speculative decoding: the head's draft step (`mtp_costs.mtp_head`)
        for name, c in _stacked([mtp_costs.mtp_head(cfg, b, pr) for b in batches]).items():
            out[name] = out[name] + c if name in out else c
    return out


@functools.lru_cache(maxsize=4)
def _attention_table(cfg: Config, pr: ops.Pricing, dense: ops.Pricing | None,
                     batches: tuple[ops.Batch, ...]) -> dict[str, ops.Cost]:
    """One attention layer of every batch (`_costs`' `attn`), as {component: a `Cost` of [n] arrays}."""
    each = []
    for b in batches:
        attn = ops.attention_block(cfg, b, pr)
        if dense is not None:
            attn["attn_proj"] = ops.attention_block(cfg, b, dense)["attn_proj"]
        each.append(attn)
    return _stacked(each)


def step_times(cfg: Config, specs: Specs, stage: ServingPlan, batches: Sequence[ops.Batch],
               kv_dtype: str | None = None, page_size: int = 256, ideal: bool = False, overlap: bool = True,
               mech: Mechanisms | None = None, pools: Pools | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`step_time` of every one of `batches` at once, the same floats: (seconds [n], {component: seconds [n]});
    the op costs are kept per pricing (`_cost_table`), so that mechanisms changing only the efficiencies re-price
    them without computing them again."""
    if ideal:
        mech = None
    specs, pr = _mech_pricing(cfg, specs, stage, kv_dtype, page_size, ideal, mech, pools)
    batches = tuple(batches)
    n = len(batches)
    s = _ideal_specs(specs) if ideal else specs
    out = {name: np.zeros(n) for name in COMPONENTS}
    for name, c in _cost_table(cfg, specs.devices, pr, batches, kv_dtype, page_size, ideal).items():
        out[name] = out[name] + ops.seconds(c, s, np.maximum)
    if not ideal:
        hidden = 1.0 - (mech.collective_overlap if mech else 0.0)
        fp8 = bool(mech and mech.fp8_allgather)
        keys = [(b.computed, b.rows, b.drafts, b.decodes if b.drafts else 0) for b in batches]  # what a step's
        # collectives read
        first = dict(zip(keys, batches))
        comms = {k: step_comms(cfg, specs, stage, b, overlap, fp8_allgather=fp8) for k, b in first.items()}
        for name in COMM:
            out[name] = out[name] + np.array([comms[k][name].seconds for k in keys], dtype=np.float64) * hidden
        if stage.fused_combine:  # the combine's remote DMAs, behind the grouped matmul (`fused_combine`)
            c = np.array([fused_combine.combine_comm(cfg, specs, b.computed).seconds for b in batches])
            out["all_to_all"] = out["all_to_all"] + fused_combine.exposed(c, out["routed_experts"], mech)
    if mech is not None:
        _mechanism_rules(out, cfg, s, pr, Steps.of(batches), mech)
    return sum(out.values()), out


def expected_a2a_rows(cfg: Config, tokens: float, ep: int) -> float:
    """Rows `tokens` tokens need under deduplicated all-to-all over ep devices (E/ep experts each), uniform
    routing: tokens · ep · (1 - C(E - E/ep, k) / C(E, k)), the expected distinct devices of a token's k experts."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    miss = math.comb(E - E // ep, k) / math.comb(E, k)
    return tokens * ep * (1 - miss)


def step_comms(cfg: Config, specs: Specs, stage: ServingPlan, batch: ops.Batch, overlap: bool = True,
               fp8_allgather: bool = False) -> dict[str, cc.Comm]:
    """The collectives of one step per device, by component, priced on the system's topology: the ops of
    `traffic.step_collectives` (the bytes `traffic.collective_counts` states and the HLO test checks), each by its
    formula in `collectives`: an all-gather of `bytes` output as `bytes / group` shards, a reduce-scatter of
    `bytes` input, an all-reduce and an all-to-all of `bytes`; the hierarchical reduce-scatter's phases together,
    `hierarchical_reduce_scatter` of their N·D·b input with the micro-batch count the code runs.
    `fp8_allgather`: the MoE's hidden all-gather (its first) moves (1 + 4 / D) bytes per element instead of b.
    """
    out = dict(_comms(cfg, specs, stage, batch.computed, batch.rows, overlap, fp8_allgather,
                      traffic.step_collectives))
    if batch.drafts:  # the MTP head's draft step: its layer's collectives over every token, then one a sequence
        head = mtp_layer_config(cfg)
        for tokens, rows in [(batch.computed, max(batch.seqs, 1))] + [(batch.decodes, batch.decodes)] * (
                batch.drafts - 1):
            for name, c in _comms(head, specs, stage, tokens, rows, overlap, fp8_allgather,
                                  traffic.step_collectives).items():
                out[name] = cc.Comm(out[name].seconds + c.seconds, out[name].wire_bytes + c.wire_bytes)
    return out


@functools.lru_cache(maxsize=4096)  # a step's collectives depend on its token and row counts only
def _comms(cfg: Config, specs: Specs, stage: ServingPlan, computed: int, rows: int, overlap: bool, fp8_allgather: bool,
           listed=traffic.step_collectives) -> dict[str, cc.Comm]:
    """`step_comms` by counts; `listed` (the function listing the ops) is part of the key: a patched
    `traffic.step_collectives` is read, not a cached result."""
    out = {name: cc.Comm(0.0, 0.0) for name in COMM}
    if specs.devices == 1:
        return out
    plan = bind_to(stage, cfg, specs)
    dp = plan.dp
    shape = traffic.StepShape(tokens=computed / dp, seqs=rows / dp)
    ops_ = listed(plan, cfg, shape, specs.kind)

    def add(name: str, comm: cc.Comm, runs: float) -> None:
        out[name] = cc.Comm(out[name].seconds + comm.seconds * runs, out[name].wire_bytes + comm.wire_bytes * runs)

    first_moe_ag = True
    for op in ops_:
        if fp8_allgather and op.part == "moe" and op.kind == "all-gather" and first_moe_ag:
            first_moe_ag = False
            b = traffic.wire_itemsize(cfg.dtype, specs.kind)
            op = dataclasses.replace(op, bytes=op.bytes * (1 + 4 / cfg.hidden_size) / b)
        if op.part == "moe_rs_chip":  # priced with its core phase
            continue
        if op.part == "moe_rs_core":
            m = op.runs // cfg.num_layers
            add("reduce_scatter", cc.hierarchical_reduce_scatter(specs, op.bytes * m, m, overlap), cfg.num_layers)
        else:
            add(op.kind.replace("-", "_"), op_comm(specs, op), op.runs)
    return out


def op_comm(specs: Specs, op: traffic.Op) -> cc.Comm:
    """One run of a flat collective `op` (a `traffic.Op`) by its kind's formula in `collectives`: an all-gather of
    `bytes` output as `bytes / group` shards, a reduce-scatter of `bytes` input, an all-reduce, an all-to-all; an op
    over the cores of one chip (`op.over == "core"`) on the core-to-core link."""
    if op.over == "core":
        specs = cc.within_chip(specs)
    if op.kind == "all-gather":
        return cc.all_gather(specs, op.bytes / op.group, op.group)
    if op.kind == "reduce-scatter":
        return cc.reduce_scatter(specs, op.bytes, op.group)
    if op.kind == "all-reduce":
        return cc.all_reduce(specs, op.bytes, op.group)
    if op.kind == "all-to-all":
        return cc.all_to_all(specs, op.bytes, op.group)
    raise ValueError(f"no formula for a {op.kind!r} in costmodel.collectives")
