"""What one stage of the ladder buys over the stage before it, per component, from the cost model: the figures
each chapter opens with (recorded by its notebook, quoted as `{{ result: NN.<file>.stages.<stage>.<workload>.* }}`).

    buys = stage_gain("dp_ep")                      # over "baseline", the stage before it in the ladder
    buys["8k/1k"]["gain"], buys["8k/1k"]["ms_per_1k_tokens"]["moe"], buys["8k/1k"]["component_change"]["moe"]

1. `costmodel.predict` of the stage and of the previous one, for each workload (8k/1k prefill-heavy, 1k/8k
   decode-heavy) at `concurrency` requests on the system (TPU7x-8 by default), FP8 KV cache (predict's default);
2. the whole-slice throughput (input + output tokens/s) of each, and their ratio `gain` (`change` = gain - 1);
3. per component group (GROUPS: attention, GDN, MoE, collectives, other): milliseconds the slice spends on it per
   1,000 tokens served (`breakdown_fraction / total_tokens_per_s`, so the groups sum to 1 / throughput and two
   stages compare over the same work), before and after, the milliseconds saved, and the relative change of each
   (`component_change`: after / before - 1; 0 where the group costs nothing before).
4. the stage's uncertainty band (`band_total_tokens_per_s`: [low, high] tokens/s, predict's one-at-a-time extremes
   of the labelled assumptions), where its prediction carries one (those made here do).
The baseline has no previous stage: only its own figures.
"""

from __future__ import annotations

from typing import Any

GROUPS = {"attention": ("attn_proj", "attn_core"), "gdn": ("gdn_proj", "gdn_core", "gdn_conv"),
          "cache": ("cache_copies",),
          "moe": ("router", "shared_expert", "routed_experts", "expert_scales", "permute", "onehot_permute",
                  "moe_rows"),
          "collectives": ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"),
          "other": ("norms", "glue", "embed_lm_head", "sampling", "host")}
WORKLOADS = {"8k/1k": (8192, 1024), "1k/8k": (1024, 8192)}
KEPT = ("total_tokens_per_s", "output_tokens_per_s", "median_ttft_s", "median_tpot_s", "max_running_per_rank",
        "mean_step_s", "dp", "tp")


def previous_stage(stage: str) -> str | None:
    """The stage before `stage` in the ladder (None for the first)."""
    from qwen35_lib.plan import LADDER

    if stage not in LADDER:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(LADDER)}")
    i = LADDER.index(stage)
    return LADDER[i - 1] if i else None


def ms_per_1k_tokens(prediction: dict) -> dict[str, float]:
    """Milliseconds per 1,000 tokens (input + output) the slice spends in each component group of GROUPS."""
    if not prediction.get("fits"):
        raise ValueError(f"stage {prediction['stage']!r} does not fit ({prediction.get('reason')}): no breakdown")
    fraction, rate = prediction["breakdown_fraction"], prediction["total_tokens_per_s"]
    unknown = set(fraction) - {c for parts in GROUPS.values() for c in parts}
    if unknown:
        raise ValueError(f"components {sorted(unknown)} are in no group of stage_gain.GROUPS: add them there")
    return {g: 1e6 * sum(fraction.get(c, 0.0) for c in parts) / rate for g, parts in GROUPS.items()}


def stage_gain(stage: str, previous: str | None = "ladder", concurrency: int = 512,
               model: str = "qwen3.5-397b-a17b", hardware: str = "tpu7x-8",
               predictions: dict[tuple[str, str], dict] | None = None, **kwargs: Any) -> dict:
    """The module doc's record for `stage` over `previous` ("ladder": the stage before it; None: none).
    `predictions` maps (stage, workload) to `predict` documents already made (reused, not recomputed; the ones made
    here are added to it, so that stages sharing one dict predict each stage once); `kwargs` go to `predict`.
    Only `stage`'s own predictions carry the band (unless `band=False`): the previous stage's are read for their
    throughput and breakdown, and a band re-prices the schedule at both ends of every swept assumption."""
    from qwen35_lib.costmodel import predict

    previous = previous_stage(stage) if previous == "ladder" else previous
    made = predictions if predictions is not None else {}
    band = kwargs.pop("band", True)

    def get(st: str, wl: str, with_band: bool) -> dict:
        if (st, wl) not in made or (with_band and "band" not in made[st, wl]):
            isl, osl = WORKLOADS[wl]
            made[st, wl] = predict(model, hardware, st, isl, osl, concurrency, roofline=False, band=with_band,
                                   **kwargs)
        return made[st, wl]

    out: dict[str, Any] = dict(stage=stage, previous=previous, concurrency=concurrency, model=model,
                               hardware=hardware)
    for wl in WORKLOADS:
        after = get(stage, wl, band)
        row = {k: after[k] for k in KEPT}
        row["ms_per_1k_tokens"] = ms_per_1k_tokens(after)
        if "band" in after:
            row["band_total_tokens_per_s"] = after["band"]["total_tokens_per_s"]
        if previous is not None:
            before = get(previous, wl, False)
            row["previous_total_tokens_per_s"] = before["total_tokens_per_s"]
            row["gain"] = after["total_tokens_per_s"] / before["total_tokens_per_s"]
            row["change"] = row["gain"] - 1
            row["previous_ms_per_1k_tokens"] = ms_per_1k_tokens(before)
            saved = {g: row["previous_ms_per_1k_tokens"][g] - row["ms_per_1k_tokens"][g] for g in GROUPS}
            row["saved_ms_per_1k_tokens"] = saved
            row["component_change"] = {g: (row["ms_per_1k_tokens"][g] / b - 1) if b else 0.0
                                       for g, b in row["previous_ms_per_1k_tokens"].items()}
        out[wl] = row
    return out


def expert_bytes(stage: str, requests: int = 512, model: str = "qwen3.5-397b-a17b",
                 hardware: str = "tpu7x-8") -> dict[str, float]:
    """What one MoE layer's routed experts cost one device in a decode step of `requests` tokens, in the cost
    model's accounting: `experts_hit` of its `local_experts`, and `bytes_per_param`, the HBM bytes (reads and
    materialized copies) the step moves per expert parameter the device holds.

    1. the stage's `costmodel.step.pricing` on the system and `costmodel.moe_costs.moe_block` of a decode step of n =
       `requests` tokens and of 2n;
    2. each one's routed-expert bytes C = W + A n: weights W (every local expert hit at both sizes, checked) and
       rows A n, linear in the tokens; so W = 2 C(n) - C(2n);
    3. W over the device's expert parameters (local experts x 3 D F, the FFN split under a TP MoE)."""
    from qwen35_lib.costmodel import moe_costs, ops, serving_model, specs
    from qwen35_lib.costmodel.experts import expected_distinct
    from qwen35_lib.costmodel.step import pricing
    from qwen35_lib.plan import any_stage

    cfg, sp = serving_model(model), specs.get(hardware)
    pr = pricing(cfg, sp, any_stage(stage))
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    local = E // pr.ep if pr.moe == "ep" else E
    hit = expected_distinct(requests, E, k) * local / E
    if local - hit > 1e-3 * local:
        raise ValueError(f"{requests} tokens hit {hit:.2f} of {local} local experts: the weights' bytes cannot be "
                         "separated from the rows'; use more requests")
    routed = [moe_costs.moe_block(cfg, ops.Batch(decodes=n), pr)["routed_experts"] for n in (requests, 2 * requests)]
    weights = 2 * routed[0].hbm_bytes - routed[1].hbm_bytes
    params = local * 3 * cfg.hidden_size * cfg.moe_ffn / (pr.tp if pr.moe == "tp" else 1)
    return dict(stage=stage, requests=requests, local_experts=local, experts_hit=hit,
                bytes_per_param=weights / params)


def gain_table(record: dict) -> str:
    """`stage_gain`'s record as text: one line per workload, then ms per 1k tokens by group (before -> after)."""
    lines = []
    for wl in WORKLOADS:
        r = record[wl]
        head = f"{record['stage']} at {wl}, {record['concurrency']} requests: {r['total_tokens_per_s']:,.0f} tokens/s"
        if "band_total_tokens_per_s" in r:
            head += " (band {:,.0f}-{:,.0f})".format(*r["band_total_tokens_per_s"])
        if record["previous"] is not None:
            head += (f" (over {record['previous']}: {r['previous_total_tokens_per_s']:,.0f} tokens/s, "
                     f"{r['gain']:.2f}x)")
        lines.append(head + "; ms per 1k tokens by component:")
        for g in GROUPS:
            now = r["ms_per_1k_tokens"][g]
            if record["previous"] is None:
                lines.append(f"  {g:<12} {now:8.2f}")
            else:
                lines.append(f"  {g:<12} {r['previous_ms_per_1k_tokens'][g]:8.2f} -> {now:8.2f}  "
                             f"({r['component_change'][g]:+7.1%})")
    return "\n".join(lines)


__all__ = ["GROUPS", "WORKLOADS", "expert_bytes", "gain_table", "ms_per_1k_tokens", "previous_stage", "stage_gain"]
