"""A step already timed, re-priced under other serving mechanisms without its op costs: what a band's ends of the
mechanisms that only scale or replace components of a step (`RESCALED`) cost, from the nominal breakdown
(`step.step_time` / `step.step_times`'s own rules, as factors; exactly what timing the step again gives,
tests/costmodel/test_retime.py)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from qwen35_lib.config import Config
from qwen35_lib.costmodel import ops
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.specs import Specs
from qwen35_lib.costmodel.step import COMM, Steps, pricing, where
from qwen35_lib.plan import ServingPlan

# Mechanisms that only scale or replace components of a step already timed (`retimed`): a band's end of one of these
# is priced from the nominal breakdown instead of from the op costs again (exactly; tests/costmodel/test_retime)
RESCALED = ("host_step_overhead_s", "host_step_time_sync_s", "async_scheduling", "collective_overlap",
            "attention_kernel_efficiency", "mixed_step_attention", "sparsecore_permute")


@functools.lru_cache(maxsize=256)  # asked once per step of a schedule, for the same two mechanisms
def _rescaled_only(old: Mechanisms, new: Mechanisms) -> bool:
    return all(getattr(old, f) == getattr(new, f) for f in old.__dataclass_fields__ if f not in RESCALED)


def retimed(cfg: Config, specs: Specs, stage: ServingPlan, batch: ops.Batch | Steps, breakdown: dict[str, float],
            old: Mechanisms, new: Mechanisms) -> dict[str, float] | None:
    """`breakdown` (a step of `batch` under `old`) under `new`, when the two differ only in RESCALED mechanisms
    (else None): step_time's own rules, item by item, as factors: the host time replaced, the collectives by
    (1 - overlap) ratio, the attention core by its efficiency and mixed-step ratios, the SparseCore permute share
    (production's MoE overheads, per row and per layer call, share `moe_rows`: their ends are priced again)."""
    if not _rescaled_only(old, new):
        return None
    out = dict(breakdown)
    host = new.host_step_overhead_s if new.async_scheduling else new.host_step_time_sync_s
    out["host"] = np.full_like(out["host"], host) if isinstance(out["host"], np.ndarray) else host
    if new.collective_overlap != old.collective_overlap:
        if old.collective_overlap >= 1:
            return None
        f = (1 - new.collective_overlap) / (1 - old.collective_overlap)
        for name in COMM:
            out[name] = out[name] * f
    if new.attention_kernel_efficiency != old.attention_kernel_efficiency:
        if not (old.attention_kernel_efficiency and new.attention_kernel_efficiency):
            return None
        out["attn_core"] = out["attn_core"] * (old.attention_kernel_efficiency / new.attention_kernel_efficiency)
    if new.mixed_step_attention != old.mixed_step_attention:
        mixed = (batch.decodes != 0) & (batch.prefill_tokens != 0)
        out["attn_core"] = where(mixed, out["attn_core"] * (new.mixed_step_attention / old.mixed_step_attention),
                                 out["attn_core"])
    if new.sparsecore_permute != old.sparsecore_permute:
        pr = pricing(cfg, specs, stage)
        if pr.moe_impl == "pallas" and pr.production_moe:
            big = batch.computed * cfg.num_experts_per_tok > old.onehot_permute_threshold
            out["permute"] = where(big, out["permute"] * (new.sparsecore_permute / old.sparsecore_permute),
                                   out["permute"])
    return out


def retimed_many(cfg: Config, specs: Specs, stage: ServingPlan, batches: Sequence[ops.Batch],
                 breakdown: dict[str, np.ndarray], old: Mechanisms, new: Mechanisms) -> dict[str, np.ndarray] | None:
    """`retimed` of every one of `batches` at once: `breakdown` {component: seconds [n]} (as `step_times` gives)."""
    return retimed(cfg, specs, stage, Steps.of(tuple(batches)), breakdown, old, new)


__all__ = ["RESCALED", "retimed", "retimed_many"]
