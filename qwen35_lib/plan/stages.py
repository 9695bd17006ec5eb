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
`tpu_inference_3050`, the plan tpu-inference's published Qwen3.5 figures ran. `resolve_layout(stage, config, n)`
binds a stage to the mesh of n devices as the cost model reads it (checked as the engine checks a layout).

    cfg = stage_config(get_config("qwen3.5-mini"), "fused_ag")   # dp8_ep8, replicate, fuse_allgather=True
"""

from __future__ import annotations

import dataclasses
import functools

from qwen35_lib.config import LAYOUTS, ROUTINGS, Config
from qwen35_lib.plan.kernels import FAMILIES
from qwen35_lib.plan.mesh import abstract_mesh
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
    """A stage from parts (the plan flags: --layout, --routing, ...), checked: the collective flags need an EP
    layout with routing 'replicate' (the engine's own rule, `check_layout`). kernels None: as the config says."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    if routing is not None and routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; use one of {ROUTINGS}")
    if kernels is not None and kernels not in FAMILIES:
        raise ValueError(f"unknown kernels {kernels!r}; use one of {FAMILIES}")
    ep = get_layout(layout).moe == "ep"
    if (fuse_allgather or hierarchical_rs) and not ep:
        raise ValueError(f"fuse_allgather and hierarchical_rs apply to EP layouts with routing='replicate'; layout "
                         f"{layout!r} is not one")
    if (fuse_allgather or hierarchical_rs) and routing != "replicate":
        raise ValueError(f"fuse_allgather and hierarchical_rs apply to routing='replicate' only; got "
                         f"routing={routing!r}")
    return ServingPlan(f"{layout}/{routing if ep else 'tp'}", layout, routing if ep else None,
                       fuse_allgather, hierarchical_rs, kernels)


def stage_config(config: Config, stage: str | ServingPlan, backend: str | None = None) -> Config:
    """`config` set up as `stage`: layout, routing, collective flags and the kernel of every slot for `backend`
    (`plan.kernels.family_kernels`: "xla" the XLA twins, "pallas" every slot's Pallas kernel)."""
    return (get_stage(stage) if isinstance(stage, str) else stage).apply(config, backend)


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
EXTRA = {GOOGLE_BASELINE.name: GOOGLE_BASELINE, TPU_INFERENCE_3050.name: TPU_INFERENCE_3050}


def any_stage(name: str | ServingPlan) -> ServingPlan:
    """A ladder stage or one of `EXTRA` (`google_baseline`, `tpu_inference_3050`)."""
    if isinstance(name, ServingPlan):
        return name
    return EXTRA[name] if name in EXTRA else get_stage(name)


@functools.lru_cache(maxsize=1024)  # called for every simulated step; plans, configs are frozen
def resolve_layout(stage: ServingPlan, config: Config, devices: int) -> ServingPlan:
    """The stage bound to the mesh of `devices` devices, checked against the model by `bind(mesh, config)` (the
    engine's own check: KV heads that do not divide, experts that do not divide the EP size).

    One device is `single`, whatever the stage says; an 8-device instance runs as its general form on another
    device count (`dp8_ep8` on 4 devices is `dp_ep`: DP4 x EP4). The result is `stage` itself, bound: its
    `.dp`, `.tp`, `.ep`, `.moe` come from the mesh.
    """
    if devices == 1:
        return dataclasses.replace(stage, layout="single", routing=None, fuse_allgather=False,
                                   hierarchical_rs=False).bind(abstract_mesh(1))
    if devices % 2:
        raise ValueError(f"{devices} devices do not form whole chips of 2 TensorCores; use an even device count")
    mesh = abstract_mesh(devices)
    plan = stage
    if stage.devices is not None and stage.devices != devices:
        plan = dataclasses.replace(stage, layout=stage.general)
    plan.bind(mesh, config)  # the engine's check, of the plan itself (its kernels do not change it)
    return plan.bind(mesh)


__all__ = ["EXTRA", "GOOGLE_BASELINE", "LADDER", "STAGES", "TPU_INFERENCE_3050", "any_stage", "custom_stage",
           "get_stage", "resolve_layout", "stage_config"]
