"""What a prediction's memory check reads: the bytes one device holds under a plan (weights, the KV and GDN pools
for a number of requests a rank, the MTP head's with speculative decoding) from `engine.cache`'s declared cache split
by the plan (`traffic.resident_bytes`); one request's share; the pools per layer that the engine's layer scan copies
(`step.Pools`)."""

from __future__ import annotations

import dataclasses

from qwen35_lib.config import Config
from qwen35_lib.costmodel import ops, traffic
from qwen35_lib.costmodel.specs import Specs
from qwen35_lib.costmodel.step import Pools, bind_to
from qwen35_lib.engine.cache import CacheShape
from qwen35_lib.plan import ServingPlan


def weight_bytes_per_device(cfg: Config, sp: Specs, stage: ServingPlan) -> float:
    """Weights one device holds under the stage's plan on the system's devices (`traffic.resident_bytes`: each
    declared weight over the ways the plan splits it; replicated ones, such as the router and norms, whole)."""
    return float(traffic.weight_bytes(bind_to(stage, cfg, sp), cfg))


def resident_bytes_per_device(cfg: Config, sp: Specs, stage: ServingPlan, requests_per_rank: int, tokens: int,
                              kv_dtype: str | None, page_size: int, drafts: int = 0) -> dict[str, float]:
    """What the engine allocates on one device for `requests_per_rank` requests of `tokens` tokens each: weights,
    the KV pool (every request's whole pages + the engine's null page) and the GDN pool (a slot each + the null
    slot), from `engine.cache.declare_cache` split by the plan (`traffic.resident_bytes`). With `drafts` (speculative
    decoding, `EngineConfig.speculative_tokens`) the GDN pool holds each slot's verification checkpoints too
    (`CacheShape.verify`), and the MTP head's weights and its one-layer KV pool are added
    (`traffic.mtp_resident_bytes`: `mtp_weight_bytes`, `mtp_kv_bytes`)."""
    plan = bind_to(stage, cfg, sp)
    cache = CacheShape.for_requests(requests_per_rank * plan.dp, tokens, ranks=plan.dp, page_size=page_size,
                                    kv_dtype=kv_dtype)
    if drafts:
        cache = dataclasses.replace(cache, verify=drafts + 1)
    r = traffic.resident_bytes(plan, cfg, cache)
    out = {"weight_bytes": r["weights"], "kv_bytes": r["kv"], "gdn_state_bytes": r["gdn_state"]}
    if drafts:
        head = traffic.mtp_resident_bytes(plan, cfg, cache)
        out.update(mtp_weight_bytes=head["weights"], mtp_kv_bytes=head["kv"])
    return out


def engine_pools(cfg: Config, sp: Specs, stage: ServingPlan, requests_per_rank: int, tokens: int,
                 kv_dtype: str | None, page_size: int, drafts: int = 0) -> Pools:
    """The cache pools, per layer on one device, of an engine sized for `requests_per_rank` requests of `tokens`
    tokens (`resident_bytes_per_device`): what its layer scan copies every step (`step.Pools`)."""
    r = resident_bytes_per_device(cfg, sp, stage, requests_per_rank, tokens, kv_dtype, page_size, drafts)
    z = ops.sizes(cfg)
    return Pools(kv=r["kv_bytes"] / max(z["n_attn"], 1), gdn=r["gdn_state_bytes"] / max(z["n_gdn"], 1))


def request_bytes_per_device(cfg: Config, sp: Specs, stage: ServingPlan, tokens: int, kv_dtype: str | None,
                             page_size: int = 1, drafts: int = 0) -> float:
    """Cache one request of `tokens` tokens puts on each device holding it: its whole pages and its GDN slot
    (the pools for two requests less those for one; with `drafts`, its checkpoints and its pages of the head's
    pool too)."""
    one, two = (resident_bytes_per_device(cfg, sp, stage, n, tokens, kv_dtype, page_size, drafts) for n in (1, 2))
    return float(sum(two.values()) - sum(one.values()))
