"""The optimization ladder: one table of stages, read by the engine, the cost model, the benchmarks and the
ahead-of-time compiles, budget and placement. A stage is a named `ServingPlan`: a layout + MoE routing + collective
flags + kernel family; its sizes come from the mesh it is bound to (`plan.bind(mesh)`):

| stage       | layout     | routing     | collectives per MoE layer                              | kernels |
|-------------|------------|-------------|--------------------------------------------------------|---------|
| `baseline`  | tp8_kvrep  | (TP MoE)    | all-reduce after the mixer, all-reduce after the MoE   | XLA     |
| `dp_ep`     | dp8_ep8    | all_to_all  | a2a dispatch + a2a combine                             | XLA     |
| `replicate` | dp8_ep8    | replicate   | AG hidden + AG ids + AG weights (3), reduce-scatter     | XLA     |
| `fused_ag`  | dp8_ep8    | replicate   | AG hidden + AG packed ids/weights (2), reduce-scatter   | XLA     |
| `hier_rs`   | dp8_ep8    | replicate   | 2 AGs, hierarchical RS (core, then chip), micro-batched | XLA     |
| `kernels`   | dp8_ep8    | replicate   | as hier_rs                                             | Pallas  |

Beside the ladder (`EXTRA`, `any_stage`): `google_baseline`, the TP8 baseline Google started from, and
`tpu_inference_3050`, the plan tpu-inference's published Qwen3.5 figures ran. A stage runs on n devices as
`stage.on_devices(n)` (the cost model's systems), bound to a mesh and checked against a model by `bind`:

    plan = get_stage("fused_ag").bind(make_mesh(), config)   # dp8_ep8, replicate, fuse_allgather=True
"""

from __future__ import annotations

import dataclasses

from qwen35_lib.plan.kernels import FAMILIES
from qwen35_lib.plan.layouts import LAYOUTS, ROUTINGS
from qwen35_lib.plan.record import ServingPlan, get_layout

STAGES: dict[str, ServingPlan] = {s.name: s for s in (
    ServingPlan("baseline", "tp8_kvrep"),
    ServingPlan("dp_ep", "dp8_ep8", "all_to_all"),
    ServingPlan("replicate", "dp8_ep8", "replicate"),
    ServingPlan("fused_ag", "dp8_ep8", "replicate", fuse_allgather=True),
    ServingPlan("hier_rs", "dp8_ep8", "replicate", fuse_allgather=True, hierarchical_rs=True),
    ServingPlan("kernels", "dp8_ep8", "replicate", fuse_allgather=True, hierarchical_rs=True, kernels="pallas"),
)}
LADDER = tuple(STAGES)


def get_stage(name: str) -> ServingPlan:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return STAGES[name]


def custom_stage(layout: str, routing: str | None = "replicate", fuse_allgather: bool = False,
                 hierarchical_rs: bool = False, kernels: str | None = "xla") -> ServingPlan:
    """A stage from parts (the plan flags: --layout, --routing, ...), checked: the collective flags need a
    data-parallel EP layout with routing 'replicate' (`ServingPlan.collective_flags_problem`, the rule `bind`
    reads). kernels None: each slot the platform's default."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    if routing is not None and routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; use one of {ROUTINGS}")
    if kernels is not None and kernels not in FAMILIES:
        raise ValueError(f"unknown kernels {kernels!r}; use one of {FAMILIES}")
    ep = get_layout(layout).moe == "ep"
    plan = ServingPlan(f"{layout}/{routing if ep else 'tp'}", layout, routing if ep else None,
                       fuse_allgather, hierarchical_rs, kernels)
    problem = plan.collective_flags_problem()  # the record's one rule, as `bind` reads it
    if problem:
        raise ValueError(problem)
    return plan


# The baseline Google started from, as we read it (issue 13, item 2): tpu-inference's TP8 before the DP/EP work:
# heads split 8 ways with the 2 KV heads duplicated, the MoE split over its FFN dim, and already its own Pallas
# kernels (ragged paged attention, the grouped matmul). Not a ladder stage: the ladder's `baseline` is this
# project's XLA path. How sure: the layout is tpu-inference's default TP serving (--tensor-parallel-size=8 without
# enable_dp_attention / --enable-expert-parallel, as server.sh reads); that the 3.1x / 4.7x were measured from it
# is an inference, the post itself not found (data/published.json 'reported_ladder').
GOOGLE_BASELINE = dataclasses.replace(custom_stage("tp8_kvrep", None, kernels="pallas"), name="google_baseline")
# The setup tpu-inference #3050 measured (issue 30, item 2): DP8 attention x EP8 with token replication, the fused
# (packed) routing all-gather, its Pallas kernels, and the MoE output returned by XLA's psum_scatter: the SparseCore
# hierarchical reduce-scatter kernel was off (ENABLE_RS_KERNEL unset, and the server's LIBTPU_INIT_ARGS turn the
# reduce-scatter offload off: tests/e2e/benchmarking/inferencex/qwen3.5/server.sh at 6a873c307). The published
# comparison predicts this plan; the ladder keeps its own `kernels` stage.
TPU_INFERENCE_3050 = dataclasses.replace(STAGES["kernels"], name="tpu_inference_3050", hierarchical_rs=False)
# The layouts tpu-inference's sharding table serves Qwen3.5-397B with below c64 (issue 55; PRs #3079, #3116): TP8_EP
# (attention and GDN tensor-parallel with the KV heads duplicated, experts EP8) and DP4TP2_EP, as this engine runs them
# (token replication, XLA kernels): the ahead-of-time sweep compiles them beside the ladder, `predict --layout auto`
# prices them beside dp8_ep8.
LAYOUT_STAGES = {s.name: s for s in (ServingPlan("tp8_ep8", "tp8_ep8", "replicate"),
                                     ServingPlan("dp4_tp2_ep8", "dp4_tp2_ep8", "replicate"))}
# Beyond production's published setup (issue 50, item 4): the kernels stage with the MoE's combine fused into the
# grouped matmul, each routed row sent home by remote DMA as its row tile finishes (`kernels.moe.fused_ep`),
# overlapped with the next tiles' matmuls, in place of the local combine and the hierarchical reduce-scatter:
# production's fused EP MoE (tpu-inference #3288, #3346) does the same. Not a ladder stage: the chapters' ladder
# stops at `kernels`.
FUSED_EP = ServingPlan("fused_ep", "dp8_ep8", "replicate", fuse_allgather=True, kernels="pallas", fused_combine=True)
EXTRA = {GOOGLE_BASELINE.name: GOOGLE_BASELINE, TPU_INFERENCE_3050.name: TPU_INFERENCE_3050, FUSED_EP.name: FUSED_EP}


def any_stage(name: str | ServingPlan) -> ServingPlan:
    """A ladder stage or one of `EXTRA` (`google_baseline`, `tpu_inference_3050`, `fused_ep`) or `LAYOUT_STAGES`."""
    if isinstance(name, ServingPlan):
        return name
    return EXTRA.get(name) or LAYOUT_STAGES.get(name) or get_stage(name)


__all__ = ["EXTRA", "FUSED_EP", "GOOGLE_BASELINE", "LADDER", "LAYOUT_STAGES", "STAGES", "TPU_INFERENCE_3050",
           "any_stage", "custom_stage", "get_stage"]
