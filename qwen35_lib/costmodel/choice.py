"""Layouts by concurrency (issue 55): the cost model prices every layout that fits and serves the best.

`choose(model, hardware, isl, osl, concurrency, ...)` (`predict --layout auto`):
1. the candidates: each layout of `CANDIDATES` (`candidates`: the caller's routing and kernels; the collective flags
   where a layout takes them, the data-parallel EP layouts with routing replicate), as `predict` binds them to the
   system (on another device count the general forms: a candidate that binds to a layout already priced is dropped);
2. `predict` each for the workload and concurrency (no band, no roofline: the ranking reads total tokens/s);
3. the candidate with the highest total (input + output) tokens/s among those that fit is served: `predict` again
   with the caller's band / explain / roofline, its document gaining `layout_choice` (`picked`, `runner_up`, `margin`
   = picked / runner-up - 1, and every candidate's throughput, TPOT and TTFT, or why it does not fit).
Nothing here names a concurrency: the prices decide (the replicated attention and GDN weights every data-parallel
rank reads, the KV heads tensor parallelism duplicates, the collectives of each, the scheduler's ranks).

`setup` says how each candidate's server is set: "library" (`predict`'s defaults: the DP 8 recipe's slice budget, 8 x
max(ISL / 8, 1024) tokens and 512 sequences a step, split over the layout's ranks) or "tpu-inference" (`SWEEP_SOURCE`:
the server.sh of tpu-inference's Qwen3.5 sweep at the commit of its published SHARDING_TABLE, every layout under the
same rules at its own DP size: `tpu_inference_setup`; `recipe` emits the same settings). A candidate priced as
tpu-inference's engine runs it (`engine="tpu-inference"`) is set as that sweep set it unless `setup` says otherwise.
A `max_batched_tokens` or `max_seqs` the caller gives is used for every candidate as given.

`table(model, hardware, isl, osl, concurrencies)` (`python -m qwen35_lib.costmodel layouts`): step 2 at each
concurrency of `CONCURRENCIES`, with the best layout, the runner-up and the margin in each row.
"""

from __future__ import annotations

from typing import Any

from qwen35_lib.config import Config
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.predict import predict, serving_model
from qwen35_lib.costmodel.specs import Specs
from qwen35_lib.costmodel.step import bind_to
from qwen35_lib.plan import TPU_INFERENCE_3050, ServingPlan, get_layout

# tpu-inference's Qwen3.5 presets as this library names them (TP8_EP, DP4TP2_EP, DP8_EP) and the naive TP baseline
CANDIDATES = ("tp8_kvrep", "tp8_ep8", "dp4_tp2_ep8", "dp8_ep8")
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RANK_BY = "total_tokens_per_s"


ENGINES = ("this", "tpu-inference")
SETUPS = ("library", "tpu-inference")
SWEEP_SOURCE = ("https://github.com/vllm-project/tpu-inference/blob/d134ed202ff4b992fdb5ae8ed45c43d70e683448/tests/e2e/"
                "benchmarking/inferencex/qwen3.5/server.sh (MAX_NUM_BATCHED_TOKENS = ISL / DP_SIZE floored at 1024, "
                "capped at 2048; MAX_NUM_SEQS = CONC x 2 / DP_SIZE; DP_SCHED_BATCH_PREFILL=true; bench.sh: "
                "RANDOM_RANGE_RATIO 0.8, 10 x CONC prompts)")


def tpu_inference_setup(isl: int, concurrency: int, dp: int) -> dict[str, int]:
    """The server settings of tpu-inference's Qwen3.5 sweep for one point (`SWEEP_SOURCE`), per DP rank:
    `max_batched_tokens` = min(max(ISL // DP, 1024), 2048) (2048: larger budgets hit an XLA error for async
    collectives, the script says), `max_seqs` = max(1, 2 x CONC // DP). Its bench.sh's 10 x CONC prompts at range
    ratio 0.8 and its DP_SCHED_BATCH_PREFILL=true are `predict`'s defaults already."""
    return dict(max_batched_tokens=min(max(isl // dp, 1024), 2048), max_seqs=max(1, 2 * concurrency // dp))


def resolve_setup(setup: str | None, engine: str) -> str:
    """`setup`, or where None the one that goes with `engine` (tpu-inference's engine: its sweep's settings)."""
    setup = setup or ("tpu-inference" if engine == "tpu-inference" else "library")
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; use one of {SETUPS}")
    return setup


def candidates(routing: str = "replicate", fuse_allgather: bool = False, hierarchical_rs: bool = False,
               kernels: str | None = "xla", layouts: tuple[str, ...] = CANDIDATES, engine: str = "this"
               ) -> list[ServingPlan]:
    """One plan per layout: the EP layouts with `routing`, the data-parallel EP layouts with the collective flags
    when `routing` is replicate (tp_ep has no all-gather to fuse), the TP layouts without either. `engine`: "this"
    (named by the layout: priced as this library's engine runs it, as `predict --layout` does) or "tpu-inference"
    (named as `plan.TPU_INFERENCE_3050`, which the cost model prices as tpu-inference's engine runs a plan:
    `step.OTHER_ENGINE`; the top-k ids and weights packed under attention DP, as it always does)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use one of {ENGINES}")
    out = []
    for layout in layouts:
        ep = get_layout(layout).moe == "ep"
        name = layout if engine == "this" else TPU_INFERENCE_3050.name
        plan = ServingPlan(name, layout, routing if ep else None, kernels=kernels)
        flags = plan.collective_flags_apply  # the plan record's rule
        fuse = fuse_allgather or engine == "tpu-inference"
        out.append(plan.replace(fuse_allgather=fuse and flags, hierarchical_rs=hierarchical_rs and flags))
    return out


def _setup_kwargs(model: str | Config, hardware: str | Specs, plan: ServingPlan, isl: int, concurrency: int,
                  setup: str, kwargs: dict) -> dict:
    """`kwargs` with the server settings of `setup` for `plan` (those the caller gave kept)."""
    if setup == "library":
        return kwargs
    cfg = serving_model(model) if isinstance(model, str) else model
    sp = specs_lib.get(hardware) if isinstance(hardware, str) else hardware
    own = tpu_inference_setup(isl, concurrency, bind_to(plan, cfg, sp).dp)
    return {**kwargs, **{k: v for k, v in own.items() if kwargs.get(k) is None}}


def rank(model: str | Config, hardware: str | Specs, isl: int, osl: int, concurrency: int,
         plans: list[ServingPlan], setup: str = "library", **kwargs: Any) -> list[dict]:
    """Every plan of `plans` priced (`predict`, no band, no roofline) under `setup`'s server settings, best first:
    those that fit by `RANK_BY`, then those that do not (with the reason). A plan that binds to a layout already
    priced is left out."""
    rows, seen = [], set()
    for plan in plans:
        r = predict(model, hardware, plan, isl, osl, concurrency, band=False, roofline=False,
                    **_setup_kwargs(model, hardware, plan, isl, concurrency, setup, kwargs))
        key = (r["layout"], r["routing"], r["fuse_allgather"], r["hierarchical_rs"])
        if key in seen:
            continue
        seen.add(key)
        row = dict(layout=plan.layout, bound_layout=r["layout"], plan=plan, fits=r["fits"])
        if r["fits"]:
            row.update({k: r[k] for k in ("total_tokens_per_s", "output_tokens_per_s", "median_tpot_s",
                                          "median_ttft_s", "mean_step_s", "max_running_per_rank",
                                          "max_batched_tokens_per_rank", "max_seqs_per_rank")})
        else:
            row["reason"] = r["reason"]
        rows.append(row)
    fit = sorted((r for r in rows if r["fits"]), key=lambda r: -r[RANK_BY])
    return fit + [r for r in rows if not r["fits"]]


def _summary(rows: list[dict]) -> dict:
    """{picked, runner_up, margin, candidates} of ranked rows (`rank`), JSON-able."""
    fit = [r for r in rows if r["fits"]]
    best = fit[0] if fit else None
    runner = fit[1] if len(fit) > 1 else None
    return dict(by=RANK_BY, picked=best and best["layout"], runner_up=runner and runner["layout"],
                margin=best[RANK_BY] / runner[RANK_BY] - 1 if runner else None,
                candidates=[{k: v for k, v in r.items() if k != "plan"} for r in rows])


def choose(model: str | Config = "qwen3.5-397b-a17b", hardware: str | Specs = "tpu7x-8", isl: int = 8192,
           osl: int = 1024, concurrency: int = 512, *, routing: str = "replicate", fuse_allgather: bool = False,
           hierarchical_rs: bool = False, kernels: str | None = "xla", band: bool = False, explain: bool = False,
           roofline: bool = True, layouts: tuple[str, ...] = CANDIDATES, engine: str = "this",
           setup: str | None = None, **kwargs: Any) -> dict:
    """`predict` of the best layout (the module doc), with `layout_choice`; where none fits, the best candidate's
    refusal (`fits: false`) with `layout_choice`. `engine`: whose engine prices the candidates (`candidates`);
    `setup`: their server settings (the module doc; None: the engine's)."""
    setup = resolve_setup(setup, engine)
    plans = candidates(routing, fuse_allgather, hierarchical_rs, kernels, layouts, engine)
    rows = rank(model, hardware, isl, osl, concurrency, plans, setup, **kwargs)
    best = rows[0]
    doc = predict(model, hardware, best["plan"], isl, osl, concurrency, band=band and best["fits"],
                  explain=explain and best["fits"], roofline=roofline,
                  **_setup_kwargs(model, hardware, best["plan"], isl, concurrency, setup, kwargs))
    doc["layout_choice"] = dict(_summary(rows), engine=engine, setup=setup)
    return doc


def table(model: str | Config = "qwen3.5-397b-a17b", hardware: str | Specs = "tpu7x-8", isl: int = 8192,
          osl: int = 1024, concurrencies: tuple[int, ...] = CONCURRENCIES, *, routing: str = "replicate",
          fuse_allgather: bool = False, hierarchical_rs: bool = False, kernels: str | None = "xla",
          layouts: tuple[str, ...] = CANDIDATES, engine: str = "this", setup: str | None = None,
          **kwargs: Any) -> dict:
    """{"isl", "osl", "layouts", "setup", "rows": [{"concurrency", "picked", "runner_up", "margin", "candidates"}]}:
    the ranking (`rank`) at each concurrency under `setup` (None: the engine's; the module doc)."""
    setup = resolve_setup(setup, engine)
    plans = candidates(routing, fuse_allgather, hierarchical_rs, kernels, layouts, engine)
    rows = []
    for c in concurrencies:
        rows.append(dict(concurrency=c, **_summary(rank(model, hardware, isl, osl, c, plans, setup, **kwargs))))
    return dict(isl=isl, osl=osl, routing=routing, kernels=kernels, engine=engine, setup=setup, layouts=list(layouts),
                rows=rows)


# the step's components by the mechanism that separates the layouts (`layout_mechanisms`)
MECHANISMS = {
    "dense weights": ("attn_proj", "gdn_proj", "shared_expert", "embed_lm_head", "router"),  # copied per DP rank
    "KV reads": ("attn_core",),  # tensor parallelism duplicates the 2 KV heads
    "GDN state": ("gdn_core", "gdn_conv"),
    "collectives": ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"),
    "routed experts": ("routed_experts", "expert_scales", "moe_rows", "permute", "onehot_permute"),
}


def layout_mechanisms(model: str | Config = "qwen3.5-397b-a17b", hardware: str | Specs = "tpu7x-8", isl: int = 8192,
                      osl: int = 1024, concurrency: int = 4, *, kernels: str | None = "pallas",
                      layouts: tuple[str, ...] = CANDIDATES, engine: str = "tpu-inference",
                      setup: str | None = None, **kwargs: Any) -> dict[str, dict[str, float]]:
    """{layout: {mechanism: ms per 1,000 tokens served}} at one concurrency (`predict` of each candidate plan, no
    band, no roofline): each `MECHANISMS` group of the step's components, "other" (host, norms, ...), and "total"
    (one over the throughput). Why a layout wins: the dense weights every data-parallel rank reads whole, the KV
    heads tensor parallelism duplicates, the collectives each layout runs. `setup`: as `table`'s."""
    setup = resolve_setup(setup, engine)
    out = {}
    for plan in candidates(kernels=kernels, layouts=layouts, engine=engine):
        r = predict(model, hardware, plan, isl, osl, concurrency, band=False, roofline=False,
                    **_setup_kwargs(model, hardware, plan, isl, concurrency, setup, kwargs))
        if not r["fits"]:
            continue
        per_1k = 1e6 / r["total_tokens_per_s"]  # ms per 1,000 tokens: the whole step's share
        frac = r["breakdown_fraction"]
        row = {m: per_1k * sum(frac.get(k, 0.0) for k in ks) for m, ks in MECHANISMS.items()}
        row["other"] = per_1k - sum(row.values())
        row["total"] = per_1k
        out[plan.layout] = row
    return out


def format_table(t: dict) -> str:
    """The table as text: a row per concurrency, per layout total tokens/s and median TPOT (* the pick), then the
    pick, the runner-up and the margin."""
    lays = t["layouts"]
    head = f"{'conc':>5} " + " ".join(f"{name:>22}" for name in lays) + f"  {'best':<12} {'next':<12} {'margin':>7}"
    lines = [f"ISL {t['isl']} / OSL {t['osl']}, routing {t['routing']}, kernels {t['kernels']}, priced as "
             f"{t.get('engine', 'this')} engine, {t.get('setup', 'library')} setup: total tokens/s | median TPOT ms "
             "per layout (* served)", head]
    for row in t["rows"]:
        cells = {c["layout"]: c for c in row["candidates"]}
        out = []
        for name in lays:
            c = cells.get(name)
            if c is None or not c["fits"]:
                out.append(f"{'-' if c is None else 'does not fit':>22}")
            else:
                mark = "*" if name == row["picked"] else " "
                out.append(f"{c['total_tokens_per_s']:>11,.0f} {c['median_tpot_s'] * 1e3:>8.1f}{mark}")
        margin = f"{row['margin']:+7.1%}" if row["margin"] is not None else f"{'-':>7}"
        lines.append(f"{row['concurrency']:>5} " + " ".join(out) +
                     f"  {row['picked'] or '-':<12} {row['runner_up'] or '-':<12} {margin}")
    return "\n".join(lines)


__all__ = ["CANDIDATES", "CONCURRENCIES", "ENGINES", "MECHANISMS", "SETUPS", "SWEEP_SOURCE", "candidates", "choose",
           "format_table", "layout_mechanisms", "rank", "resolve_setup", "table", "tpu_inference_setup"]
