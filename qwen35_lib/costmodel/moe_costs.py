"""The MoE layer's op costs, per device, for one step (`ops`' Batch, Pricing and Cost): the router, the shared expert,
the routed experts and the permutes (`moe_block`), production's layer around its grouped matmul (`layer_costs`,
`costmodel.moe_layer`), the capacity kernel's slots. Kernel families change what is moved:
- `ragged_dot` (XLA on TPU): ideal FLOPs, but every local expert's weights are read, and FP8 weights are
  dequantized to a bf16 copy first: on TPU, the bytes per parameter the compiled step moves
  (`Pricing.expert_bytes_per_param`: the scan's slice and its relayouts, a float32 scale broadcast, the
  dequantizing fusions, bf16 relayouts, the matmul's read: 'xla_tpu_fp8_expert_bytes'), elsewhere +2 B written +2 B
  read per parameter; `capacity`: every expert computes C
  slots (C from `kernels.moe.xla.moe_capacity`'s rule), every expert's weights read; `loop` (the CPU default,
  `kernels.moe.xla.moe_loop`): only the experts hit, each copied once (XLA:CPU copies an expert's weights before its
  matmuls), real rows only in tiles of at most 32 rows (the small-matmul regime); `pallas` (the Pallas grouped matmul):
  ideal FLOPs, only the experts hit are read, FP8 read as FP8.
"""

from __future__ import annotations

import math

import numpy as np

from qwen35_lib.config import Config
from qwen35_lib.costmodel.experts import expected_distinct
from qwen35_lib.costmodel.ops import ITEMSIZE, Batch, Cost, Pricing, dense_rows, sizes


def capacity_slots(rows: float, experts: int, sigmas: float = 4.0) -> int:
    """Slots per expert of `kernels.moe.xla.moe_capacity`: mean + sigmas sqrt(mean) + 2, rounded up to a multiple
    of 8."""
    mean = rows / experts
    return -(-int(np.ceil(mean + sigmas * np.sqrt(mean) + 2)) // 8) * 8


def moe_block(cfg: Config, b: Batch, pr: Pricing) -> dict[str, Cost]:
    """One MoE layer: router, shared expert, routed experts (weights touched per `pr.moe_impl`), permutes."""
    z = sizes(cfg)
    D, E, k, F = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_ffn
    T_dev = b.computed / pr.dp  # tokens whose router and shared expert this device runs
    copies = pr.weight_passes - 1  # a sliced copy: written once and read once more
    router_copies = copies if pr.router_passes is None else pr.router_passes - 1
    router = Cost(2 * T_dev * z["router"], 10 * E * T_dev, z["router"] * z["act"] + T_dev * E * 4, 3,
                  z["router"] * z["act"] * router_copies) + dense_rows(pr, T_dev, 2 * T_dev * z["router"])
    # the shared expert's FFN is split as the heads are (`ffn`: tp, tp_ep, dp_tp2_ep's cores): a layout's ranks times
    # its head ways are its devices (the ideal roofline's dense pricing, dp = tp = ep, keeps it whole per device)
    shared_w = z["shared"] / (pr.tp if pr.moe == "tp" or pr.dp * pr.tp == pr.ep else 1)
    shared = Cost(2 * T_dev * shared_w, 0, shared_w * z["act"] + T_dev * D * z["act"] * 3, 4,
                  shared_w * z["act"] * copies) + dense_rows(pr, T_dev, 2 * T_dev * shared_w)
    if pr.moe == "ep":
        experts_dev, f_dev = E / pr.ep, F
        rows = b.computed * k / pr.ep  # every token of the slice, k copies, spread over the EP devices
    else:
        experts_dev, f_dev = E, F / pr.tp
        rows = b.computed * k
    ideal = 2 * rows * 3 * D * f_dev
    w_expert = 3 * D * f_dev  # params of one expert on this device
    small = 0.0
    scales = None
    copies = (pr.weight_passes if pr.expert_passes is None else pr.expert_passes) - 1
    if pr.moe == "ep":
        rows *= pr.expert_imbalance  # the busiest device's
        ideal *= pr.expert_imbalance
    if pr.moe_impl == "pallas":
        touched = expected_distinct(b.tokens, E, k) * experts_dev / E
        if pr.gmm_tile_rows and touched:  # whole tiles of tile_m rows per expert group hit
            tm = pr.gmm_tile_rows
            ideal *= touched * math.ceil(rows / touched / tm) * tm / rows
        mxu, wbytes, copy = ideal, touched * w_expert * z["exp_item"], touched * w_expert * z["exp_item"] * copies
        if not pr.production_moe and cfg.expert_dtype == "float8_e4m3fn":
            # this library's grouped matmul takes the FP8 block scales repeated along lanes (`moe_pallas`): XLA
            # expands every local expert's each layer (compact read, expanded written), the kernel reads the
            # touched experts' expanded
            bs = cfg.fp8_block_size
            expanded = 4 * (D // bs * 2 * f_dev + f_dev // bs * D)  # one expert's scales, bytes
            scales = Cost(bytes=experts_dev * expanded * (1 + 1 / bs), launches=2)
            wbytes += touched * expanded
    elif pr.moe_impl == "native":  # the touched experts read in place, once; no copies, no dequantization (f32/bf16)
        touched = expected_distinct(b.tokens, E, k) * experts_dev / E
        mxu, wbytes, copy = ideal, touched * w_expert * z["exp_item"], 0.0
    elif pr.moe_impl == "loop":
        touched = expected_distinct(b.tokens, E, k) * experts_dev / E
        dequant = 4 if cfg.expert_dtype == "float8_e4m3fn" else 0
        mxu, small = 0.0, ideal
        wbytes, copy = touched * w_expert * z["exp_item"], touched * w_expert * (z["exp_item"] * (2 + copies) + dequant)
    else:
        dequant = 4 if cfg.expert_dtype == "float8_e4m3fn" else 0  # bf16 copy written and read
        wbytes = experts_dev * w_expert * z["exp_item"]
        copy = experts_dev * w_expert * (pr.expert_bytes_per_param - z["exp_item"] if pr.expert_bytes_per_param
                                         else z["exp_item"] * copies + dequant)
        mxu = ideal
        if pr.moe_impl == "capacity":  # C slots per expert, few rows each: the small-matmul regime
            mxu, small = 0.0, 2 * experts_dev * capacity_slots(rows, experts_dev) * 3 * D * f_dev
    routed = Cost(mxu, 0, wbytes + rows * (2 * D + 3 * f_dev) * z["act"], 4, copy, small)
    # the permute moves the static buffer the code sorts (`parallel.routing.local_experts`): under EP every
    # device's N·min(k, E/ep) rows (dropless worst case, the gathered or received tokens), not just its copies
    buffer = b.computed * min(k, E // pr.ep) if pr.moe == "ep" and pr.static_buffers else rows
    out = {"router": router, "shared_expert": shared, "routed_experts": routed,
           "permute": Cost(0, 0, buffer * D * z["act"] * 4, 6)}
    if scales is not None:
        out["expert_scales"] = scales
    if pr.moe_impl == "pallas" and pr.static_buffers:  # the layer around the grouped matmul (`moe_layer`)
        out.update(layer_costs(cfg, b.computed, pr.onehot_threshold, pr.row_overhead_s, pr.permute_passes,
                               pr.layer_fixed_s))
        sums = b.computed * D * z["act"]  # the combine's sums of every gathered token (replicate routing)
        if pr.combine_sum_hbm_bytes and sums > pr.combine_sum_hbm_bytes:  # written once (its float32 stays in VMEM)
            out["permute"] = out["permute"] + Cost(bytes=sums)
        gathered = b.computed * D * z["act"]  # every rank's tokens, all-gathered
        if pr.gathered_relayouts and gathered > SCOPED_VMEM_BYTES:  # each read and written
            out["permute"] = out["permute"] + Cost(bytes=2 * pr.gathered_relayouts * gathered,
                                                   launches=pr.gathered_relayouts)
    return out


# XLA:TPU's scoped VMEM on TPU7x: 33,554,432 bytes, the `scoped_memory_configs` size of every op in the stored
# TPU7x-8 texts (data/aot/hlo/): an array larger than it cannot be placed in VMEM. The kernels stage's Pallas combine
# writes its sums in the activations' dtype from a float32 accumulator (`kernels.permute.pallas.gather_reduce`): in
# VMEM at decode (bf16[512, 4096], 4.2 MB), in HBM in the mixed step (bf16[8704, 4096], 71 MB; it wrote float32 sums
# there before, read and cast by XLA: 21.4 GB a mixed step); where between the two XLA switches is not measured
SCOPED_VMEM_BYTES = 33_554_432


def layer_costs(cfg: Config, tokens: float, onehot_threshold: int, row_overhead_s: float,
                permute_passes: float = 2.0, fixed_s: float = 0.0) -> dict[str, Cost]:
    """Production's MoE layer around its grouped matmul (`costmodel.moe_layer`'s items 1-3), one layer, one device;
    `tokens` = N, the slice's tokens (every device sorts and permutes all N·k routed rows under token replication);
    `permute_passes` over the [N·k, D] rows (production's: written, then read; this library's kernels stage: its
    compiled gathers, relayouts and scatter-add, `kernels.kernels_moe_permute_passes`), with no one-hot permute and
    no per-row overhead (threshold and overhead 0); `fixed_s`: the layer call's time outside its grouped matmul
    that does not grow with its rows, charged to `moe_rows` with the per-row overhead."""
    D, k = cfg.hidden_size, cfg.num_experts_per_tok
    act = ITEMSIZE[cfg.dtype]
    rows = tokens * k  # [N·k] routed rows
    onehot = rows <= onehot_threshold
    permute_flops = 4 * k * tokens * tokens * D if onehot else 0.0  # 2 matmuls of 2·(N·k)·N·D
    return {"onehot_permute": Cost(mxu_flops=permute_flops, launches=2 if onehot else 0),
            "permute": Cost(bytes=permute_passes * rows * D * act, launches=2),
            "moe_rows": Cost(seconds=rows * row_overhead_s + fixed_s)}
