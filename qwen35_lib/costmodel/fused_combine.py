"""The fused EP combine's price (`ServingPlan.fused_combine`, stage `fused_ep`; `kernels.moe.fused_ep`).

The grouped-matmul kernel sends each routed row home by remote DMA as its row tile finishes, while the next tiles
compute; no local combine writes partial sums and no reduce-scatter follows (`traffic.moe_layer_ops` lists only the
all-gathers). Per MoE layer and device:
1. rows sent: the copies routed to its experts, N_p·k / n in the mean (N_p the step's tokens padded to the devices),
   each a row of D elements in the model's dtype: X = N_p·k·D·b / n bytes;
2. their transfer time: every device sends X spread over all n devices (its own share stays home), the pattern of an
   all-to-all: `collectives.all_to_all(X)` on the ring (its launch standing for the kernel's barrier);
3. overlap: the transfers run behind the grouped matmul of the same layer, so the layer's MoE time is the larger of
   the two, not their sum; `Mechanisms.fused_combine_overlap` (data/costmodel_assumptions.json) is the fraction of the
   matmul's time the transfers can hide behind (1: all but the last tile's rows, whose sends start as the kernel ends).
   Exposed seconds = c - overlap · min(c, r), c the step's transfer time and r its `routed_experts` time (every MoE
   layer alike, so the step's totals stand for each layer's). Charged to the `all_to_all` component (its wire).
HBM (`permute_passes`): no sorted copy of the rows is written and no partial sum [N, D] either; the kernel fetches
the routed rows (N·k/ep a device) and their outputs land in their owners' recv, which is the grouped matmul's own row
traffic (`ops.moe`'s routed rows, read and written once); what is left is the weighing of a device's received
copies: recv [n·k, D] read, the output [n, D] written, (1 + 1/k) / ep passes over the [N·k, D] rows the kernels stage
moves 3 times (its compiled fact `kernels_moe_permute_passes`). The expert sort is int32 work, not charged. Besides,
XLA relays the all-gathered tokens [N, D] out twice a layer for the kernel's row fetches (`GATHERED_RELAYOUTS`, on
the SparseCore), in HBM once larger than the scoped VMEM (`moe_costs.moe_block`).
"""

from __future__ import annotations

import functools

import numpy as np

from qwen35_lib.config import Config
from qwen35_lib.costmodel import collectives as cc
from qwen35_lib.costmodel import traffic
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.specs import Specs


@functools.lru_cache(maxsize=4096)  # by the step's computed tokens alone
def combine_comm(cfg: Config, specs: Specs, computed: int) -> cc.Comm:
    """The step's remote-DMA combine over every MoE layer (steps 1-2 of the module doc) on one device."""
    n = specs.devices
    if n <= 1:
        return cc.NONE
    Np = computed + (-computed % n)
    X = Np * cfg.num_experts_per_tok * cfg.hidden_size * traffic.wire_itemsize(cfg.dtype, specs.kind) / n
    one = cc.all_to_all(specs, X, n)
    return cc.Comm(one.seconds * cfg.num_layers, one.wire_bytes * cfg.num_layers)


# [N, D] relayouts of the all-gathered tokens a MoE layer in the fused_ep stage's compile: the all-gather's result
# from (16, 128) tiles to (8, 128) and a [n, ranks, D/128, 128] view of it transposed, each a SparseCore copy
# (data/aot/hlo/fused_ep-8k_1k-mixed.hlo.gz: 2 x 71 MB read and written a layer, 17.1 GB a step;
# tests/costmodel/test_compiled.py holds the count to the text); its decode step's are smaller than the scoped VMEM
GATHERED_RELAYOUTS = 2


def permute_passes(cfg: Config, ep: int) -> float:
    """Passes over the [N·k, D] routed rows the fused layer's permute moves (the module doc): (1 + 1/k) / ep."""
    return (1 + 1 / cfg.num_experts_per_tok) / ep


def exposed(combine_s, routed_s, mech: Mechanisms | None):
    """Seconds of the combine not hidden behind the grouped matmul (step 3), scalars or [n] arrays; without
    mechanisms (`Mechanisms.off`, the model with serial collectives) none is hidden."""
    hide = mech.fused_combine_overlap if mech is not None else 0.0
    return combine_s - hide * np.minimum(combine_s, routed_s)


__all__ = ["GATHERED_RELAYOUTS", "combine_comm", "exposed", "permute_passes"]
