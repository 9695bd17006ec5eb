"""The stage ladder as the cost model sees it: the stages of `qwen35_lib.parallel.stages` (the one table, read
here, not copied), and each stage's layout reduced to the integers the op costs need on n devices.

A cost-model `Layout` says what is split over the devices: `dp` data-parallel ranks (tokens and their caches
split), `tp` tensor-parallel ways for attention and GDN (heads split), and how the MoE runs: `tp` (every device
holds a 1/tp slice of every expert's FFN dim), `ep` (each device owns E/n whole experts) or `local` (one device).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import AbstractMesh

from qwen35_lib.config import LAYOUTS, ROUTINGS, Config
from qwen35_lib.kernels.registry import FAMILIES as KERNELS
from qwen35_lib.parallel import layouts
from qwen35_lib.parallel.mesh import AXES, axis_size
from qwen35_lib.parallel.stages import LADDER, STAGES, Stage, custom_stage, get_stage


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    dp: int  # data-parallel ranks (attention and GDN over their own sequences)
    tp: int  # ways attention / GDN heads are split
    moe: str  # "tp", "ep" or "local"


def _mesh(devices: int) -> AbstractMesh:
    """The ('chip', 'core') mesh of `devices` devices, 2 cores a chip (1 device: one core)."""
    return AbstractMesh((max(1, devices // 2), min(2, devices)), AXES)


def resolve_layout(stage: Stage, config: Config, devices: int) -> Layout:
    """The stage's layout on `devices` devices, checked against the model by `parallel.layouts.check_layout`
    (the engine's own check: KV heads that do not divide, experts that do not divide the EP size, ...).

    One device is `single`, whatever the stage says; the 8-way layouts scale to the devices present (`dp8_ep8`
    on 4 devices is DP4 x EP4).
    """
    if devices == 1:
        return Layout("single", 1, 1, "local")
    if devices % 2:
        raise ValueError(f"{devices} devices do not form whole chips of 2 TensorCores; use an even device count")
    mesh = _mesh(devices)
    lay = layouts.check_layout(config.replace(layout=stage.layout, routing=stage.routing or "replicate",
                                              fuse_allgather=stage.fuse_allgather,
                                              hierarchical_rs=stage.hierarchical_rs), mesh)
    return Layout(lay.name, axis_size(mesh, lay.batch_axes), axis_size(mesh, lay.axes("q_heads")), lay.moe)


__all__ = ["KERNELS", "LADDER", "LAYOUTS", "ROUTINGS", "STAGES", "Layout", "Stage", "custom_stage", "get_stage",
           "resolve_layout"]
