"""The serving plan: how a model is served on a mesh, as data of its own, below the kernels and the model.

One `ServingPlan` record (`plan.record`), what is asked: the layout (the logical-axis rules of `plan.layouts`), the
MoE routing, the collective options, the kernel family or each slot's kernel (`plan.kernels`) and the cache dtypes.
Bound to a mesh and a model (`plan.bind(mesh, config)`), it is a `BoundPlan` (`plan.bound`): the mesh's sizes
(`plan.mesh`: the `('chip', 'core')` mesh of any device count), the platform, one implementation per slot, the placed
config. The stage ladder (`plan.stages`) is a list of named plans, read by the engine, the ahead-of-time compiles,
the cost model and the benchmarks alike.
Every command that takes a plan reads the same flags (`add_arguments(parser)`, `from_args(args)`: `plan.cli`).
This package imports nothing of `qwen35_lib` but `config` (for the type of the model it is checked against).

    plan = get_stage("fused_ag").bind(make_mesh(), config)   # a BoundPlan: dp8_ep8, replicate, fuse_allgather=True
                                                             # on the devices present (kernels resolved), or a refusal
"""

from qwen35_lib.plan.bound import BoundPlan
from qwen35_lib.plan.cli import add_arguments, from_args
from qwen35_lib.plan.kernels import FAMILIES, family_kernels
from qwen35_lib.plan.layouts import GENERAL, INSTANCES, LAYOUT_RULES, LAYOUTS, ROUTINGS
from qwen35_lib.plan.mesh import ALL, AXES, abstract_mesh, axis_size, make_mesh
from qwen35_lib.plan.record import (
    LAYOUT_PLANS,
    SINGLE,
    ServingPlan,
    get_layout,
    kv_copies,
    kv_heads_per_device,
    micro_batches,
)
from qwen35_lib.plan.stages import (
    EXTRA,
    GOOGLE_BASELINE,
    LADDER,
    LAYOUT_STAGES,
    STAGES,
    TPU_INFERENCE_3050,
    any_stage,
    custom_stage,
    get_stage,
)

__all__ = ["ALL", "AXES", "EXTRA", "FAMILIES", "GENERAL", "GOOGLE_BASELINE", "INSTANCES", "LADDER", "LAYOUTS",
           "LAYOUT_PLANS", "LAYOUT_RULES", "LAYOUT_STAGES", "ROUTINGS", "SINGLE", "STAGES", "TPU_INFERENCE_3050",
           "BoundPlan", "ServingPlan",
           "abstract_mesh", "add_arguments", "any_stage", "axis_size", "custom_stage", "family_kernels", "from_args",
           "get_layout", "get_stage", "kv_copies", "kv_heads_per_device", "make_mesh", "micro_batches"]
