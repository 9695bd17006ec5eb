"""Many devices: the `('chip', 'core')` mesh, layouts as logical-to-physical rules, MoE routing, collectives.

    mesh = make_mesh()                                   # 8 devices as ('chip': 4, 'core': 2); any count works
    config = get_config("qwen3.5-mini", layout="dp8_ep8", routing="replicate", fuse_allgather=True)
    weights = shard_weights(config, init_weights(config), mesh)
"""

from qwen35_lib.parallel.layouts import (
                                         Layout,
                                         batch_sharding,
                                         check_layout,
                                         get_layout,
                                         placed_config,
                                         shard_weights,
                                         spec,
                                         weight_shardings,
)
from qwen35_lib.parallel.mesh import ALL, AXES, EIGHT, axis_size, make_mesh
from qwen35_lib.parallel.plan import ServingPlan, plan_of

__all__ = ["ALL", "AXES", "EIGHT", "Layout", "ServingPlan", "plan_of", "axis_size", "batch_sharding", "check_layout",
           "get_layout", "make_mesh", "placed_config", "shard_weights", "spec", "weight_shardings"]
