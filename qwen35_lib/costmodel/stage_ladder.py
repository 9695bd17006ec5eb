"""The stage ladder predicted (`ladder`: `predict` for every stage of `plan.LADDER` and workload, with each
stage's gain) and explained (`ladder_explained`: what each stage buys per component, beside the published gains)."""

from __future__ import annotations

from typing import Any

from qwen35_lib.config import Config
from qwen35_lib.costmodel.predict import predict
from qwen35_lib.costmodel.specs import Specs


def ladder(model: str | Config = "qwen3.5-397b-a17b", hardware: str | Specs = "tpu7x-8",
           workloads: tuple[tuple[int, int], ...] = ((8192, 1024), (1024, 8192)), concurrency: int = 512,
           stages: tuple[str, ...] | None = None, google_baseline: bool = True, **kwargs: Any) -> list[dict]:
    """`predict` for every stage of the ladder and workload; each row gains `gain` (over the previous stage),
    `vs_baseline` and, with `google_baseline`, `google_baseline_total_tokens_per_s` and `vs_google_baseline` (over
    the `google_baseline` plan, predicted for the same workload; not a ladder stage)."""
    from qwen35_lib.plan import LADDER

    rows = []
    for isl, osl in workloads:
        prev = base = None
        g = predict(model, hardware, "google_baseline", isl, osl, concurrency, **kwargs) if google_baseline else None
        gt = g["total_tokens_per_s"] if g and g.get("fits") else None
        for name in stages or LADDER:
            r = predict(model, hardware, name, isl, osl, concurrency, **kwargs)
            r["workload"] = f"{_k(isl)}/{_k(osl)}"
            if r.get("fits"):
                base = base or r["total_tokens_per_s"]
                r["gain"] = r["total_tokens_per_s"] / prev if prev else 1.0
                r["vs_baseline"] = r["total_tokens_per_s"] / base
                if gt:
                    r["google_baseline_total_tokens_per_s"] = gt
                    r["vs_google_baseline"] = r["total_tokens_per_s"] / gt
                prev = r["total_tokens_per_s"]
            rows.append(r)
    return rows


def ladder_explained(model: str | Config = "qwen3.5-397b-a17b", hardware: str | Specs = "tpu7x-8",
                     concurrency: int = 512, workloads: tuple[tuple[int, int], ...] = ((8192, 1024), (1024, 8192)),
                     **kwargs: Any) -> dict:
    """The ladder explained, as data (issue 13, item 7; notebook 06 quotes it): per workload, each stage's total
    tokens/s, gain and ratios (`ladder`), and what it buys per component: the mean step's seconds per token
    computed, per component, before and after it (a stage changes the per-token cost; `delta_s_per_token`
    < 0 is a saving). Also the published 3.1x / 4.7x beside the model's end-to-end ratios over `baseline` and
    over `google_baseline`, and the per-token cost of `kernels` against `google_baseline` by component."""
    from qwen35_lib import data

    rows = ladder(model, hardware, workloads, concurrency, **kwargs)
    google = {f"{_k(i)}/{_k(o)}": predict(model, hardware, "google_baseline", i, o, concurrency, **kwargs)
              for i, o in workloads}
    pub = data.read_json("published.json")["reported_ladder"]
    reported = {"8k/1k": pub["prefill_heavy_gain"], "1k/8k": pub["decode_heavy_gain"]}
    out: dict[str, Any] = dict(concurrency=concurrency, reported_source=pub["source"], workloads={})
    for wl in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == wl and r.get("fits")]
        per_tok = {r["stage"]: _per_token(r) for r in rs}
        g = google[wl]
        stages, prev = [], None
        for r in rs:
            row = dict(stage=r["stage"], total_tokens_per_s=r["total_tokens_per_s"],
                       median_tpot_s=r["median_tpot_s"], median_ttft_s=r["median_ttft_s"],
                       gain=r.get("gain"), vs_baseline=r.get("vs_baseline"),
                       vs_google_baseline=r.get("vs_google_baseline"), s_per_token=per_tok[r["stage"]])
            if prev is not None:
                row["delta_s_per_token"] = _delta(per_tok[prev], per_tok[r["stage"]])
            prev = r["stage"]
            stages.append(row)
        k = next((r for r in rs if r["stage"] == "kernels"), None)
        summary = dict(reported_gain=reported.get(wl), model_vs_baseline=k and k.get("vs_baseline"),
                       model_vs_google_baseline=k and k.get("vs_google_baseline"))
        gb = None
        if g.get("fits"):
            gb = dict(total_tokens_per_s=g["total_tokens_per_s"], median_tpot_s=g["median_tpot_s"],
                      s_per_token=_per_token(g))
            if k:
                summary["kernels_vs_google_baseline_delta_s_per_token"] = _delta(gb["s_per_token"],
                                                                               per_tok["kernels"])
        out["workloads"][wl] = dict(stages=stages, google_baseline=gb, summary=summary)
    return out


def _per_token(r: dict) -> dict[str, float]:
    """Seconds per token (input + output) of the slice, by component."""
    tokens = r["total_tokens_per_s"] * r["seconds"]
    return {k: v * r["steps"] / tokens for k, v in r["breakdown_s"].items()}


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b.get(k, 0.0) - a.get(k, 0.0) for k in sorted(set(a) | set(b), key=lambda k: b.get(k, 0.0) -
                                                              a.get(k, 0.0)) if b.get(k, 0.0) != a.get(k, 0.0)}


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)
