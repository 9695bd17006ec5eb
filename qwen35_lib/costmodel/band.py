"""What a prediction rests on, from its schedule re-timed under other mechanisms (`rerun(m)`; a mechanism never
changes the schedule): `band_of` (the swept assumptions of data/costmodel_assumptions.json at their ends, one at a
time and jointly) and `explain_of` (each mechanism switched off alone, each component with its assumptions)."""

from __future__ import annotations

import dataclasses

from qwen35_lib.costmodel.assumptions import Mechanisms, component_assumptions, extremes, records


def band_of(sim, mech: Mechanisms, rerun) -> dict:
    """The uncertainty band of a prediction:
    1. one at a time: each swept assumption ('range' or 'derived') at its low and its high end, the others nominal;
    2. jointly: the pessimistic corner (every swept assumption at the end that lowered total tokens/s in step 1)
       and the optimistic corner (every one at the other end);
    3. band = [min, max] of total tokens/s and of median TPOT over steps 1-2 and the nominal."""
    rows = []
    for name, end, m in extremes(mech):
        r = rerun(m)
        rows.append(dict(assumption=name, end=end, value=getattr(m, name), total_tokens_per_s=r.total_tokens_per_s,
                         median_tpot_s=r.median_tpot_s, median_ttft_s=r.median_ttft_s))
    worse, better = {}, {}
    for name in dict.fromkeys(r["assumption"] for r in rows):
        lo, hi = (next(r for r in rows if r["assumption"] == name and r["end"] == e) for e in ("low", "high"))
        w, b = (lo, hi) if lo["total_tokens_per_s"] <= hi["total_tokens_per_s"] else (hi, lo)
        worse[name], better[name] = w["value"], b["value"]
    corners = []
    for corner, values in (("pessimistic", worse), ("optimistic", better)):
        r = rerun(dataclasses.replace(mech, **values))
        corners.append(dict(corner=corner, values=values, total_tokens_per_s=r.total_tokens_per_s,
                            median_tpot_s=r.median_tpot_s, median_ttft_s=r.median_ttft_s))
    tot = [r["total_tokens_per_s"] for r in rows + corners] + [sim.total_tokens_per_s]
    tpot = [r["median_tpot_s"] for r in rows + corners] + [sim.median_tpot_s]
    return dict(total_tokens_per_s=[min(tot), max(tot)], median_tpot_s=[min(tpot), max(tpot)],
                high_over_low=max(tot) / min(tot), extremes=rows, corners=corners)


def explain_of(sim, mech: Mechanisms, rerun) -> dict:
    """The mean step per component (each with the assumptions it rests on) and per mechanism: what switching
    that one mechanism off changes (mean step, total tokens/s), with its assumption record."""
    comps = {k: dict(seconds=v / sim.steps, fraction=v / sim.seconds, assumptions=list(component_assumptions(k)))
             for k, v in sorted(sim.breakdown.items(), key=lambda kv: -kv[1]) if v > 0}
    recs = records()
    mechs = {}
    for name in [f.name for f in dataclasses.fields(Mechanisms)]:
        off = mech.neutral(name)
        if off == mech:
            mechs[name] = dict(applied=False, assumption=recs[name])
            continue
        r = rerun(off)
        mechs[name] = dict(applied=True, value=getattr(mech, name), off_value=getattr(off, name),
                           mean_step_s_delta=sim.seconds / sim.steps - r.seconds / r.steps,
                           total_tokens_per_s_without=r.total_tokens_per_s,
                           total_tokens_per_s_ratio=sim.total_tokens_per_s / r.total_tokens_per_s,
                           assumption=recs[name])
    return dict(mean_step_s=sim.seconds / sim.steps, components=comps, mechanisms=mechs,
                other_assumptions={k: v for k, v in recs.items() if k not in mechs})
