"""The optimization ladder: one table of stages, read by the engine, the cost model, the benchmarks and the
ahead-of-time compiles, budget and placement. A stage is a named `ServingPlan` (`Stage` is that class): a layout +
MoE routing + collective flags + kernel family; its sizes come from the mesh it is bound to (`plan.bind(mesh)`):

| stage       | layout     | routing     | collectives per MoE layer                              | kernels |
|-------------|------------|-------------|--------------------------------------------------------|---------|
| `baseline`  | tp8_kvrep  | (TP MoE)    | all-reduce after the mixer, all-reduce after the MoE   | XLA     |
| `dp_ep`     | dp8_ep8    | all_to_all  | a2a dispatch + a2a combine                             | XLA     |
| `replicate` | dp8_ep8    | replicate   | AG hidden + AG ids + AG weights (3), reduce-scatter     | XLA     |
| `fused_ag`  | dp8_ep8    | replicate   | AG hidden + AG packed ids/weights (2), reduce-scatter   | XLA     |
| `hier_rs`   | dp8_ep8    | replicate   | 2 AGs, hierarchical RS (core, then chip), micro-batched | XLA     |
| `kernels`   | dp8_ep8    | replicate   | as hier_rs                                             | Pallas  |

    cfg = stage_config(get_config("qwen3.5-mini"), "fused_ag")   # dp8_ep8, replicate, fuse_allgather=True
"""

from __future__ import annotations

from qwen35_lib.config import LAYOUTS, ROUTINGS, Config
from qwen35_lib.kernels.registry import FAMILIES
from qwen35_lib.parallel.plan import ServingPlan, get_layout

Stage = ServingPlan  # a stage is a named plan: one record, not a second class

STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("baseline", "tp8_kvrep"),
    Stage("dp_ep", "dp8_ep8", "all_to_all"),
    Stage("replicate", "dp8_ep8", "replicate"),
    Stage("fused_ag", "dp8_ep8", "replicate", fuse_allgather=True),
    Stage("hier_rs", "dp8_ep8", "replicate", fuse_allgather=True, hierarchical_rs=True),
    Stage("kernels", "dp8_ep8", "replicate", fuse_allgather=True, hierarchical_rs=True, kernels="pallas"),
)}
LADDER = tuple(STAGES)


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return STAGES[name]


def custom_stage(layout: str, routing: str | None = "replicate", fuse_allgather: bool = False,
                 hierarchical_rs: bool = False, kernels: str = "xla") -> Stage:
    """A stage from parts (the CLIs' --layout/--routing), checked."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    if routing is not None and routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; use one of {ROUTINGS}")
    if kernels not in FAMILIES:
        raise ValueError(f"unknown kernels {kernels!r}; use one of {FAMILIES}")
    ep = get_layout(layout).moe == "ep"
    if hierarchical_rs and not (ep and routing == "replicate"):
        raise ValueError("hierarchical_rs applies to an EP layout with routing 'replicate' only")
    return ServingPlan(f"{layout}/{routing if ep else 'tp'}", layout, routing if ep else None,
                       fuse_allgather and ep, hierarchical_rs, kernels)


def stage_config(config: Config, stage: str | Stage, backend: str | None = None) -> Config:
    """`config` set up as `stage`: layout, routing, collective flags and the kernel of every slot for `backend`
    (`kernels.registry.family_kernels`: "xla" the XLA twins, "pallas" every slot's Pallas kernel)."""
    return (get_stage(stage) if isinstance(stage, str) else stage).apply(config, backend)


__all__ = ["LADDER", "STAGES", "ServingPlan", "Stage", "custom_stage", "get_stage", "stage_config"]
