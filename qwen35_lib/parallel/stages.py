"""The optimization ladder as runnable Configs: each stage of `qwen35_lib.costmodel.stages.STAGES` (one table
for the cost model and the code) becomes a complete `Config` for the engine.

    cfg = stage_config(get_config("qwen3.5-mini"), "fused_ag")   # dp8_ep8, replicate, fuse_allgather=True
"""

from __future__ import annotations

from qwen35_lib.config import Config
from qwen35_lib.costmodel.stages import LADDER, get_stage
from qwen35_lib.kernels.registry import target_backend


def stage_config(config: Config, stage: str, backend: str | None = None) -> Config:
    """`config` set up as `stage`: layout, routing, collective flags and kernels.

    Kernels "xla": the XLA twins (MoE: `ragged_dot` on TPU, the CPU's measured winner `capacity` elsewhere);
    "pallas": every slot's Pallas kernel (interpret mode off a TPU: numerics only).
    """
    s = get_stage(stage)
    if s.kernels == "pallas":
        kernels = dict(attention_kernel="pallas", gdn_kernel="pallas", moe_kernel="pallas", permute_kernel="pallas")
    else:
        moe = "ragged_dot" if (backend or target_backend()) == "tpu" else "capacity"
        kernels = dict(attention_kernel="xla", gdn_kernel="xla", moe_kernel=moe, permute_kernel="xla")
    return config.replace(layout=s.layout, routing=s.routing or "replicate", fuse_allgather=s.fuse_allgather,
                          hierarchical_rs=s.hierarchical_rs, **kernels)


__all__ = ["LADDER", "stage_config"]
