"""What each part of the ladder buys, attributed: the layout and the kernels as a 2 x 2, and the collective steps on
the corner that has both, from the cost model at the serving shape (512 requests, both workloads).

    rec = attribution()                       # TPU7x-8, 512 requests, 8k/1k and 1k/8k
    rec["8k/1k"]["kernels_under_tp"], rec["8k/1k"]["layout_with_pallas"], rec["collectives"]["8k/1k"]["total"]

The ladder changes the layout first (`baseline` -> `dp_ep` ... `hier_rs`, XLA's kernels throughout) and the kernels
last (`hier_rs` -> `kernels`), so its step gains answer "what did this step buy after the ones before it", not
"what does the layout buy" or "what do the kernels buy". The 2 x 2 answers those:

|                      | XLA kernels                   | Pallas kernels                          |
|----------------------|-------------------------------|-----------------------------------------|
| TP (`tp8_kvrep`)     | `baseline`                    | `google_baseline` (tpu-inference's TP8) |
| DP + EP (`dp8_ep8`)  | `hier_rs` (the ladder's last  | `kernels`                               |
|                      | XLA stage, every collective)  |                                         |

1. `costmodel.predict` of each corner for each workload (whole-slice input + output tokens/s; with `band=True`
   also its band, the one-at-a-time extremes of the labelled assumptions);
2. the four effects, each a ratio of two corners that differ in one thing: what the layout buys with XLA's kernels
   (`layout_with_xla` = hier_rs / baseline) and with Pallas kernels (`layout_with_pallas` = kernels /
   google_baseline), what the kernels buy under TP (`kernels_under_tp` = google_baseline / baseline) and under
   DP + EP (`kernels_under_dp_ep` = kernels / hier_rs); `end_to_end` = kernels / baseline;
3. each part's share of the end-to-end log-gain, averaged over the two orders (layout first, kernels first):
   `layout_share` = (log layout_with_xla + log layout_with_pallas) / 2 / log end_to_end, `kernels_share` likewise;
   they sum to 1. A share above 1 or below 0 means the other part loses throughput on its own;
4. the collective steps on the DP + EP + Pallas corner, as plan variants of `kernels` that differ only in their
   collectives (COLLECTIVE_STEPS: all-to-all dispatch, token replication, the fused all-gather, the hierarchical
   reduce-scatter): each one's throughput, its gain over the one before and `total` (kernels / the all-to-all
   variant);
5. the memory each corner needs at the serving shape, from the stored TPU7x-8 sweep (`data/aot/tpu7x-8.json`): the
   compiled step's total per device and headroom, or, for a refused step, the footprint its refusal names
   (`temporaries.refused_bytes`); a corner the sweep did not compile (`google_baseline`) says so.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

CORNERS = {("tp", "xla"): "baseline", ("tp", "pallas"): "google_baseline", ("dp_ep", "xla"): "hier_rs",
           ("dp_ep", "pallas"): "kernels"}
WORKLOADS = {"8k/1k": (8192, 1024), "1k/8k": (1024, 8192)}
# (variant name, the ladder stage whose collectives it takes): each with the Pallas kernels
COLLECTIVE_STEPS = (("dp_ep_pallas", "dp_ep"), ("replicate_pallas", "replicate"), ("fused_ag_pallas", "fused_ag"),
                    ("kernels", "hier_rs"))
SWEEP = "aot/tpu7x-8.json"


def collective_variant(name: str, collectives_of: str):
    """The `kernels` plan with the collectives (layout, routing, fused all-gather, hierarchical reduce-scatter) of
    ladder stage `collectives_of`, named `name`; `kernels` itself for `hier_rs`."""
    from qwen35_lib.plan import get_stage

    if collectives_of == "hier_rs":
        return get_stage("kernels")
    return dataclasses.replace(get_stage(collectives_of), name=name, kernels=get_stage("kernels").kernels)


def sweep_memory(stage: str, doc: dict | None = None) -> dict[str, Any]:
    """What the stored sweep says of `stage`'s decode and mixed steps at the serving shape: fits, the step's bytes
    per device (compiled total, or the refusal's footprint) and headroom; `compiled: False` when it is not there."""
    from qwen35_lib import data
    from qwen35_lib.costmodel import temporaries

    doc = doc if doc is not None else data.read_json(SWEEP)
    entry = doc["stages"].get(stage)
    out: dict[str, Any] = dict(compiled=entry is not None, usable_bytes=doc["usable_bytes"])
    for step in ("decode", "mixed"):
        e = entry["steps"].get(f"8k/1k {step}") if entry else None
        if e is None:
            continue
        total = e["total_bytes"] if e["fits"] else temporaries.refused_bytes(e.get("error", ""))
        out[step] = dict(fits=e["fits"], total_bytes=total, headroom_bytes=doc["usable_bytes"] - total
                         if total is not None else None)
    return out


def attribution(concurrency: int = 512, model: str = "qwen3.5-397b-a17b", hardware: str = "tpu7x-8",
                predictions: dict[tuple[str, str], dict] | None = None, sweep: dict | None = None,
                **kwargs: Any) -> dict[str, Any]:
    """The module doc's record. `predictions` maps (plan name, workload) to `predict` documents already made
    (reused; those made here are added); `sweep` a stored sweep document (default: the library's); `kwargs` go to
    `predict`."""
    from qwen35_lib.costmodel import predict

    made = predictions if predictions is not None else {}

    def get(plan: Any, wl: str) -> dict:
        name = plan if isinstance(plan, str) else plan.name
        if (name, wl) not in made:
            isl, osl = WORKLOADS[wl]
            made[name, wl] = predict(model, hardware, plan, isl, osl, concurrency, roofline=False, **kwargs)
        doc = made[name, wl]
        if not doc.get("fits"):
            raise ValueError(f"{name} does not fit at {wl}, {concurrency} requests ({doc.get('reason')}): "
                             "no throughput to attribute; lower the concurrency")
        return doc

    out: dict[str, Any] = dict(model=model, hardware=hardware, concurrency=concurrency, corners={},
                               collectives=dict(steps=[n for n, _ in COLLECTIVE_STEPS]))
    for (layout, kernels), stage in CORNERS.items():
        corner: dict[str, Any] = dict(layout=layout, kernels=kernels, memory=sweep_memory(stage, sweep))
        for wl in WORKLOADS:
            p = get(stage, wl)
            corner[wl] = dict(total_tokens_per_s=p["total_tokens_per_s"],
                              max_running_per_rank=p["max_running_per_rank"])
            if "band" in p:
                corner[wl]["band_total_tokens_per_s"] = p["band"]["total_tokens_per_s"]
        out["corners"][stage] = corner
    for wl in WORKLOADS:
        t = {stage: out["corners"][stage][wl]["total_tokens_per_s"] for stage in CORNERS.values()}
        e = dict(layout_with_xla=t["hier_rs"] / t["baseline"], layout_with_pallas=t["kernels"] / t["google_baseline"],
                 kernels_under_tp=t["google_baseline"] / t["baseline"], kernels_under_dp_ep=t["kernels"] / t["hier_rs"],
                 end_to_end=t["kernels"] / t["baseline"])
        total = math.log(e["end_to_end"])
        if abs(total) > 1e-9:
            e["layout_share"] = (math.log(e["layout_with_xla"]) + math.log(e["layout_with_pallas"])) / 2 / total
            e["kernels_share"] = (math.log(e["kernels_under_tp"]) + math.log(e["kernels_under_dp_ep"])) / 2 / total
        out[wl] = e
        steps: dict[str, Any] = {}
        prev = None
        for name, of in COLLECTIVE_STEPS:
            rate = get(collective_variant(name, of), wl)["total_tokens_per_s"]
            steps[name] = dict(collectives_of=of, total_tokens_per_s=rate, gain=rate / prev if prev else 1.0)
            prev = rate
        first = steps[COLLECTIVE_STEPS[0][0]]["total_tokens_per_s"]
        out["collectives"][wl] = dict(steps, total=prev / first)
    return out


def attribution_table(record: dict[str, Any]) -> str:
    """`attribution`'s record as text: the 2 x 2 per workload, the four effects, then the collective steps."""
    lines = [f"{record['model']} on {record['hardware']}, {record['concurrency']} requests: total tokens/s"]
    c = record["corners"]
    for wl in WORKLOADS:
        e = record[wl]
        rate = {stage: f"{c[stage][wl]['total_tokens_per_s']:>18,.0f}" for stage in c}
        lines += [f"{wl}:{'XLA kernels':>24}{'Pallas kernels':>18}",
                  f"  TP       {rate['baseline']}{rate['google_baseline']}   kernels buy x{e['kernels_under_tp']:.2f}",
                  f"  DP + EP  {rate['hier_rs']}{rate['kernels']}   kernels buy x{e['kernels_under_dp_ep']:.2f}",
                  f"  layout buys x{e['layout_with_xla']:.2f} with XLA's kernels, x{e['layout_with_pallas']:.2f} with "
                  f"Pallas; end to end x{e['end_to_end']:.2f}"
                  + (f" (shares of its log-gain: layout {e['layout_share']:.0%}, kernels {e['kernels_share']:.0%})"
                     if "layout_share" in e else "")]
        steps = record["collectives"][wl]
        lines.append("  collectives on DP + EP + Pallas: " + " -> ".join(
            f"{n} {steps[n]['total_tokens_per_s']:,.0f}" + (f" (x{steps[n]['gain']:.3f})" if i else "")
            for i, n in enumerate(record["collectives"]["steps"])) + f"; x{steps['total']:.2f} in all")
    for stage, corner in c.items():
        m = corner["memory"]
        if not m["compiled"]:
            lines.append(f"memory, {stage}: not in the stored sweep")
            continue
        lines.append(f"memory, {stage}: " + ", ".join(
            f"{step} {'fits' if m[step]['fits'] else 'REFUSED'}, {m[step]['total_bytes'] / 2**30:.2f} GiB of "
            f"{m['usable_bytes'] / 2**30:.2f}" for step in ("decode", "mixed") if step in m))
    return "\n".join(lines)


__all__ = ["COLLECTIVE_STEPS", "CORNERS", "WORKLOADS", "attribution", "attribution_table", "collective_variant",
           "sweep_memory"]
