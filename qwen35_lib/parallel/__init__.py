"""Many devices: the `('chip', 'core')` mesh, layouts as logical-to-physical rules, MoE routing, collectives.

    mesh = make_mesh()                                   # 8 devices as ('chip': 4, 'core': 2)
    config = get_config("qwen3.5-mini", layout="dp8_ep8", routing="replicate", fuse_allgather=True)
    weights = shard_weights(config, init_weights(config), mesh)
"""

from qwen35_lib.parallel.layouts import (
                                         Layout,
                                         batch_sharding,
                                         check_layout,
                                         get_layout,
                                         shard_weights,
                                         spec,
                                         weight_shardings,
)
from qwen35_lib.parallel.mesh import AXES, EIGHT, axis_size, make_mesh

__all__ = ["AXES", "EIGHT", "Layout", "axis_size", "batch_sharding", "check_layout",
           "get_layout", "make_mesh", "shard_weights", "spec", "weight_shardings"]
