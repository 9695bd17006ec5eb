"""Layouts and the stage ladder, as the cost model sees them (from DESIGN.md's definitions, not from code).

A `Layout` says what is split over the devices: `dp` data-parallel ranks (tokens and their caches split),
`tp` tensor-parallel ways for attention and GDN (heads split), and how the MoE runs: `tp` (every device holds a
1/tp slice of every expert's FFN dim), `ep` (each device owns E/n whole experts) or `local` (one device).
A `Stage` is a layout + MoE routing + collective flags + kernel family:

| stage       | layout     | routing     | collectives per MoE layer                              | kernels |
|-------------|------------|-------------|--------------------------------------------------------|---------|
| `baseline`  | tp8_kvrep  | (TP MoE)    | all-reduce after the mixer, all-reduce after the MoE   | XLA     |
| `dp_ep`     | dp8_ep8    | all_to_all  | a2a dispatch + a2a combine                             | XLA     |
| `replicate` | dp8_ep8    | replicate   | AG hidden + AG ids + AG weights (3), reduce-scatter     | XLA     |
| `fused_ag`  | dp8_ep8    | replicate   | AG hidden + AG packed ids/weights (2), reduce-scatter   | XLA     |
| `hier_rs`   | dp8_ep8    | replicate   | 2 AGs, hierarchical RS (core, then chip), micro-batched | XLA     |
| `kernels`   | dp8_ep8    | replicate   | as hier_rs                                             | Pallas  |
"""

from __future__ import annotations

import dataclasses

from qwen35_lib.config import Config


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    dp: int  # data-parallel ranks (attention and GDN over their own sequences)
    tp: int  # ways attention / GDN heads are split
    moe: str  # "tp", "ep" or "local"


LAYOUTS = {
    "single": Layout("single", 1, 1, "local"),
    "tp8": Layout("tp8", 1, 8, "tp"),
    "tp8_kvrep": Layout("tp8_kvrep", 1, 8, "tp"),
    "dp8_ep8": Layout("dp8_ep8", 8, 1, "ep"),
}
ROUTINGS = ("replicate", "all_to_all")
KERNELS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    layout: str
    routing: str | None = None  # EP layouts only
    fuse_allgather: bool = False
    hierarchical_rs: bool = False
    kernels: str = "xla"


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
    """A stage from parts (the CLI's --layout/--routing), checked."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    if routing is not None and routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; use one of {ROUTINGS}")
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; use one of {KERNELS}")
    ep = LAYOUTS[layout].moe == "ep"
    if hierarchical_rs and not (ep and routing == "replicate"):
        raise ValueError("hierarchical_rs applies to an EP layout with routing 'replicate' only")
    return Stage(f"{layout}/{routing if ep else 'tp'}", layout, routing if ep else None, fuse_allgather and ep,
                 hierarchical_rs, kernels)


def resolve_layout(stage: Stage, config: Config, devices: int) -> Layout:
    """The stage's layout on `devices` devices, checked against the model.

    1. one device: `single`, whatever the stage says;
    2. `tp8` refuses a model whose KV heads do not divide the TP size (the error names the fixes);
    3. an EP layout refuses an expert count that does not divide the devices;
    4. the 8-way layouts scale to the devices present (`dp8_ep8` on 4 devices is DP4 x EP4).
    """
    if devices == 1:
        return LAYOUTS["single"]
    base = LAYOUTS[stage.layout]
    if base.name == "tp8" and config.num_kv_heads % devices:
        raise ValueError(f"{config.num_kv_heads} KV heads cannot be split over {devices} devices of axis 'model'; "
                         "use layout 'dp8_ep8' or replicate KV heads ('tp8_kvrep': more KV-cache memory per device)")
    if base.moe == "ep" and config.num_experts % devices:
        raise ValueError(f"{config.num_experts} experts do not divide over {devices} devices for expert "
                         "parallelism; use a TP layout or a device count that divides the experts")
    if base.moe == "ep":
        return Layout(base.name, devices, 1, "ep")
    return Layout(base.name, 1, devices, "tp")
