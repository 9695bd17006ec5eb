"""Many devices, applied: weights and caches placed by a plan's logical-to-physical rules, MoE routing,
collectives. The plans themselves, the layouts, the stage ladder and the mesh live in `qwen35_lib.plan`.

    mesh = make_mesh()                                   # qwen35_lib.plan: 8 devices as ('chip': 4, 'core': 2)
    config = get_config("qwen3.5-mini")
    plan = get_stage("fused_ag").bind(mesh, config)      # dp8_ep8, replicate, fuse_allgather: checked once, bound
    weights = shard_weights(config, plan, init_weights(config), mesh)
"""

from qwen35_lib.parallel.shardings import batch_sharding, placed_config, shard_weights, spec, weight_shardings

__all__ = ["batch_sharding", "placed_config", "shard_weights", "spec", "weight_shardings"]
