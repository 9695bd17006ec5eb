"""The MoE layer as tpu-inference's production path runs it (token replication, two grouped matmuls), per device.

The op costs of `moe_costs.moe_block` charge the grouped matmul its weights and FLOPs. At prefill token counts that is
half of what TPU7x measures (issue 30): production's layer (tpu_inference/layers/common/fused_moe_gmm.py at the
#3050 commit) also
1. sorts the slice's N·k expert ids twice (argsort into expert order, argsort back) and counts each expert's rows,
   every device all N·k of them, since every device holds every token under token replication;
2. permutes the tokens into expert order and back: while N·k <= ONEHOT_MOE_PERMUTE_THRESHOLD (32,768 in the
   serving recipe) as two one-hot matmuls, `[N·k, N] @ [N, D]` (dispatch) and `[N, N·k] @ [N·k, D]` (combine):
   4·k·N²·D MXU FLOPs; above it as SparseCore ragged gathers;
3. moves N·k-row buffers: the permuted tokens `[N·k, D]` written and the expert outputs `[N·k, D]` read back
   for the weighted sum over k (bf16, 2 x 2 bytes an element);
4. runs the grouped matmul over its local experts (`moe_costs.moe_block`'s `pallas`: touched weights once, whole tiles
   of `gmm_tile_rows` rows an expert).
`moe_costs.layer_costs` returns items 1-3 as `Cost`s (the step model adds them to the layer's `routed_experts`):
- `onehot_permute`: the one-hot matmuls (MXU FLOPs) while N·k is under the threshold, else nothing;
- `permute`: the N·k-row buffers (HBM bytes); above the threshold the SparseCore gathers these rows, so the step
  model scales it by the `sparsecore_permute` assumption there (and only there);
- `moe_rows`: what the layer call costs outside its grouped matmul beyond the above and the collectives: the
  per-row bookkeeping of item 1 and every other [N·k]-sized pass (sorts, group counts, masks, index gathers) at
  `moe_row_overhead_s` a routed row, and `moe_layer_fixed_s` a call whatever its rows (the top-k, the sorts and
  the small ops around the two grouped matmuls, each starting and draining once a call: about 50 us a call at
  N <= 256, where the per-row term is under 20). These two constants are the only figures of this model set from
  measured data: from the time outside the grouped-matmul kernels (whole-layer device time less the kernels' own,
  both from the benchmark's device profiles) of the recorded-routing cells with N <= 1,024
  (`costmodel.validate.moe_row_overhead`), which does not depend on which experts the rows go to; the grouped
  matmul itself is priced from the specs (weights read, FLOPs) and never from the cells. Judged by every cell's
  whole-layer time: the same shape under random routing (the routing the model's touched-expert count assumes),
  the recorded cells with N >= 2,048, and the second shape (data/moe_layer_measured.json; `python -m
  qwen35_lib.costmodel validate --moe`).
`layer_time(cfg, specs, tokens, mech)` is one whole layer call at N tokens in the slice, as the benchmark times
it: these, the grouped matmul, the top-k, and the layer's collectives (hidden and routing all-gathers, the
reduce-scatter) priced by `collectives`; the prediction code never reads the measured cells.
"""

from __future__ import annotations

import dataclasses

from qwen35_lib.config import Config
from qwen35_lib.costmodel import collectives as cc
from qwen35_lib.costmodel import moe_costs, ops
from qwen35_lib.costmodel.specs import Specs


@dataclasses.dataclass(frozen=True)
class LayerTime:
    seconds: float
    breakdown: dict[str, float]  # component -> seconds


def layer_time(cfg: Config, specs: Specs, tokens: int, mech, ep: int | None = None,
               reduce_scatter: str = "flat", gathered: bool = True) -> LayerTime:
    """One MoE layer call at `tokens` tokens in the slice (EP over `ep` devices, default all), as production's
    layer runs it under `mech` (an `assumptions.Mechanisms`): the module doc's items, the grouped matmul and
    top-k of `moe_costs.moe_block`, and the hidden and routing all-gathers and the reduce-scatter of its output
    (`reduce_scatter`: "flat", XLA's `psum_scatter` as #3050 ran it). `gathered` False: the layer as tpu-inference
    runs it at its upstream defaults on a mesh without attention DP (the benchmark's second shape): the tokens come
    in replicated, so no all-gather, and `scatter_results` is off, so the combine ends in a `psum` (an all-reduce of
    the [N, D] output). The router matmul is not in the layer call the benchmark times (its logits are an input) and
    the shared expert is not in it either."""
    from qwen35_lib.costmodel.step import mech_specs

    sp = mech_specs(specs, mech)
    ep = ep or sp.devices
    pr = ops.Pricing(dp=ep, tp=1, moe="ep", ep=ep, attention="pallas", moe_impl="pallas",
                       expert_imbalance=mech.expert_imbalance, gmm_tile_rows=mech.gmm_tile_rows,
                       onehot_threshold=mech.onehot_permute_threshold, row_overhead_s=mech.moe_row_overhead_s,
                       layer_fixed_s=mech.moe_layer_fixed_s)
    b = ops.Batch(prefill_tokens=tokens, prefill_seqs=1, max_ctx=tokens)
    moe = moe_costs.moe_block(cfg, b, pr)
    out = {name: ops.seconds(moe[name], sp) for name in ("routed_experts", "onehot_permute", "permute", "moe_rows")}
    out["top_k"] = ops.seconds(dataclasses.replace(moe["router"], mxu_flops=0.0, bytes=tokens / ep * cfg.num_experts
                                                   * 4, copy_bytes=0.0), sp)
    if tokens * cfg.num_experts_per_tok > mech.onehot_permute_threshold:
        out["permute"] *= mech.sparsecore_permute
    D, k, b_act = cfg.hidden_size, cfg.num_experts_per_tok, ops.ITEMSIZE[cfg.dtype]
    hidden = 1.0 - mech.collective_overlap
    if not gathered:
        out["all_reduce"] = hidden * cc.all_reduce(sp, tokens * D * b_act, ep).seconds
        return LayerTime(sum(out.values()), out)
    out["all_gather"] = hidden * (cc.all_gather(sp, tokens / ep * D * b_act, ep).seconds +
                                  cc.all_gather(sp, tokens / ep * 2 * k * 4, ep).seconds)  # hidden; packed ids
    rs = cc.reduce_scatter(sp, tokens * D * b_act, ep) if reduce_scatter == "flat" else \
        cc.hierarchical_reduce_scatter(sp, tokens * D * b_act)
    out["reduce_scatter"] = hidden * rs.seconds
    return LayerTime(sum(out.values()), out)


__all__ = ["LayerTime", "layer_time"]
