"""The stage ladder as the cost model sees it: the stages of `qwen35_lib.parallel.stages` (the one table, read
here, not copied), each a `ServingPlan` bound to the mesh of the system's devices, whose sizes the op costs read:
`dp` data-parallel ranks (tokens and their caches split), `tp` ways attention and GDN heads are split, `ep`
expert-parallel ways, and how the MoE runs: `tp` (every device holds a 1/tp slice of every expert's FFN dim),
`ep` (each device owns E/ep whole experts) or `local` (one device).
"""

from __future__ import annotations

import dataclasses
import functools

from jax.sharding import AbstractMesh

from qwen35_lib.config import LAYOUTS, ROUTINGS, Config
from qwen35_lib.kernels.registry import FAMILIES as KERNELS
from qwen35_lib.parallel import layouts
from qwen35_lib.parallel.mesh import AXES
from qwen35_lib.parallel.plan import ServingPlan
from qwen35_lib.parallel.stages import LADDER, STAGES, Stage, custom_stage, get_stage

Layout = ServingPlan  # what the cost model reads of a stage is the bound plan itself, not a copy

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


def any_stage(name: str | Stage) -> Stage:
    """A ladder stage or `google_baseline`."""
    if isinstance(name, Stage):
        return name
    return EXTRA[name] if name in EXTRA else get_stage(name)


def _mesh(devices: int) -> AbstractMesh:
    """The ('chip', 'core') mesh of `devices` devices, 2 cores a chip (1 device: one core)."""
    return AbstractMesh((max(1, devices // 2), min(2, devices)), AXES)


@functools.lru_cache(maxsize=1024)  # called for every simulated step; plans, configs are frozen
def resolve_layout(stage: Stage, config: Config, devices: int) -> ServingPlan:
    """The stage bound to the mesh of `devices` devices, checked against the model by `parallel.layouts.
    check_layout` (the engine's own check: KV heads that do not divide, experts that do not divide the EP size).

    One device is `single`, whatever the stage says; an 8-device instance runs as its general form on another
    device count (`dp8_ep8` on 4 devices is `dp_ep`: DP4 x EP4). The result is `stage` itself, bound: its
    `.dp`, `.tp`, `.ep`, `.moe` come from the mesh.
    """
    if devices == 1:
        return dataclasses.replace(stage, layout="single", routing=None, fuse_allgather=False,
                                   hierarchical_rs=False).bind(_mesh(1))
    if devices % 2:
        raise ValueError(f"{devices} devices do not form whole chips of 2 TensorCores; use an even device count")
    mesh = _mesh(devices)
    plan = stage
    if stage.devices is not None and stage.devices != devices:
        plan = dataclasses.replace(stage, layout=stage.general)
    layouts.check_layout(plan.apply(config, "tpu"), mesh)  # kernels do not change the check; naming a backend
    # keeps the cost model from starting one (libtpu's, where it is installed)
    return plan.bind(mesh)


__all__ = ["EXTRA", "GOOGLE_BASELINE", "KERNELS", "LADDER", "LAYOUTS", "ROUTINGS", "STAGES", "TPU_INFERENCE_3050",
           "Layout", "Stage",
           "any_stage", "custom_stage", "get_stage", "resolve_layout"]
