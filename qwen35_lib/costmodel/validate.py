"""The cost model's validations: (a) CPU engine steps, (b) TPU7x ahead-of-time compiles, (c) published figures.

(a) `cpu_engine_steps(cfg, cases)`: the real engine's jitted step (`engine.step.engine_step`) on this CPU, for
    hand-made batches (`StepCase`: decodes with their context, prefill chunks), packed exactly as the engine
    packs them (`engine.batch.pack`, its buckets). Each case is compiled once, then the cases are timed
    interleaved, `repeats` rounds; the median is compared with `step_time` on the `cpu` specs (measured by
    `cpu_bench`) with the CPU kernels (the `native` MoE, XLA attention and GDN), one device.
(b) TPU7x ahead-of-time compiles against XLA's own counts: `qwen35_lib.aot.validate` (the compiler's package
    reads the cost model, not the other way round).
(c) `published_comparison()`: the rows of data/published.json next to `predict` for the same setup. Only this
    function (and `acceptance`, `notebook_data`, which call it) reads that file; `predict` never does.
(d) `moe_layer_comparison()`: the MoE layer sub-model (`moe_layer.layer_time`) against the device times of
    production's layer (data/moe_layer_measured.json, judging data); `moe_row_overhead()` derives the two constants
    set from it (`moe_row_overhead_s`, `moe_layer_fixed_s`) from the time outside the grouped-matmul kernels of the
    recorded cells with N <= 1,024 only. `moe_random_routing_comparison()`: the same shape under random routing;
    `moe_second_shape_comparison()`: the same file's second shape (Qwen3-30B-A3B's MoE, run at tpu-inference's
    upstream defaults); nothing set from either.
`notebook_data()` is everything notebook 06 quotes from issue 13 as one dict: the comparison, the acceptance
figures, the explained prediction with its band for both workloads at 512, and the ladder explained.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import numpy as np

from qwen35_lib import data
from qwen35_lib.config import Config
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.ops import Batch
from qwen35_lib.costmodel.step import step_time
from qwen35_lib.plan import ServingPlan

SINGLE_XLA = ServingPlan("single", "tp8_kvrep")  # resolves to `single` on one device; XLA kernels


@dataclasses.dataclass(frozen=True)
class StepCase:
    name: str
    decode_ctx: tuple[int, ...] = ()  # context after the step of each decoding sequence
    chunks: tuple[tuple[int, int], ...] = ()  # (new tokens, cached before) of each prefill chunk


def default_cases() -> list[StepCase]:
    """Batch sizes and prefill/decode mixes for `qwen3.5-mini` at CPU size (8 sequences, 64-token chunks)."""
    return [StepCase("decode x1", (96,)), StepCase("decode x8", (96,) * 8),
            StepCase("mixed 4 + 64", (96,) * 4, ((64, 0),)), StepCase("prefill 2 x 64", (), ((64, 0), (64, 64)))]


def case_batch(case: StepCase, D: int, T: int, S: int) -> Batch:
    """The `Batch` of a case as the compiled step computes it (D decode slots, T tokens, S logit rows)."""
    pre = sum(n for n, _ in case.chunks)
    ctxs = list(case.decode_ctx) + [n + c for n, c in case.chunks]
    return Batch(decodes=len(case.decode_ctx), decode_ctx=float(np.mean(case.decode_ctx)) if case.decode_ctx else 0.0,
                 prefill_tokens=pre, prefill_seqs=len(case.chunks),
                 prefill_ctx=float(np.mean([c for _, c in case.chunks])) if case.chunks else 0.0,
                 max_ctx=max(ctxs), padded_tokens=T, logit_rows=S)


def cpu_engine_steps(cfg: Config, weights: dict, cases: list[StepCase] | None = None, repeats: int = 5,
                     page_size: int = 16, max_num_seqs: int = 8, cpu_specs: dict | None = None) -> list[dict]:
    """Measured vs predicted seconds of the engine's step for each case (see the module doc)."""
    import jax

    from qwen35_lib.engine.batch import SeqWork, pack, stack_ranks
    from qwen35_lib.engine.engine import Engine
    from qwen35_lib.engine.engine_config import EngineConfig
    from qwen35_lib.engine.step import engine_step
    from qwen35_lib.model.layer_loop import prepare_weights

    cases = cases or default_cases()
    longest = max(max(c.decode_ctx, default=0) for c in cases) + max(sum(n for n, _ in c.chunks) for c in cases)
    if jax.default_backend() != "cpu":
        raise ValueError("the CPU validation runs the engine on the default backend, which is not the CPU here")
    eng = Engine(cfg, weights, EngineConfig(max_num_seqs=max_num_seqs, page_size=page_size,
                                            max_num_batched_tokens=max(256, cfg.gdn_chunk_size * 4),
                                            max_model_len=max(256, longest + page_size)))
    S, C = max_num_seqs, eng.chunk
    inputs = []
    rng = np.random.default_rng(0)  # distinct random tokens: repeated ones would all route to the same experts
    for case in cases:
        works, slot, next_page = [], 1, 1
        for n, start in [(1, c - 1) for c in case.decode_ctx] + list(case.chunks):
            pages = list(range(next_page, next_page + -(-(start + n) // page_size)))
            next_page += len(pages)
            works.append(SeqWork(rng.integers(2, cfg.vocab_size, n).tolist(), start, pages, slot))
            slot += 1
        dec, pre = works[: len(case.decode_ctx)], works[len(case.decode_ctx):]
        D, T = eng.step_shape(len(dec), sum(-(-len(w.tokens) // C) * C for w in pre))
        tokens, meta = stack_ranks([pack(dec, pre, D, T, S, eng.ec.pages_per_seq, C)])
        samp = dict(temperature=np.zeros((1, S), np.float32), top_k=np.zeros((1, S), np.int32),
                    top_p=np.ones((1, S), np.float32), seed=np.zeros((1, S), np.uint32),
                    position=np.zeros((1, S), np.int32))
        inputs.append((case, D, T, tokens, meta, samp))

    step_weights = prepare_weights(eng.config, eng.weights, eng.plan)  # the form the engine's step takes

    def run(i: int) -> float:
        _, _, _, tokens, meta, samp = inputs[i]
        t = time.perf_counter()
        out, eng.cache = engine_step(eng.config, eng.plan, step_weights, eng.cache, tokens, meta, samp)
        jax.block_until_ready(out)
        return time.perf_counter() - t

    compile_s = [run(i) for i in range(len(inputs))]  # warm-up: compiles each bucket
    times: list[list[float]] = [[] for _ in inputs]
    for r in range(repeats):
        for i in list(range(r % len(inputs), len(inputs))) + list(range(r % len(inputs))):
            times[i].append(run(i))
    sp = specs_lib.get("cpu", cpu_specs)
    rows = []
    for (case, D, T, *_), ts, cs in zip(inputs, times, compile_s):
        pred = step_time(cfg, sp, SINGLE_XLA, case_batch(case, D, T, S), page_size=page_size)
        measured = statistics.median(ts)
        rows.append(dict(case=case.name, D=D, T=T, measured_s=measured, predicted_s=pred.seconds,
                         ratio=pred.seconds / measured, first_call_s=cs, times_s=ts,
                         breakdown_s={k: v for k, v in pred.breakdown.items() if v}))
    return rows


def published() -> dict:
    """data/published.json (cited measurements; read only for comparison)."""
    return data.read_json("published.json")


MEASURED_STAGE = "tpu_inference_3050"  # the plan the published rows ran (`plan.TPU_INFERENCE_3050`)


def published_comparison(stages: tuple[str, ...] = ("fused_ag", "kernels", MEASURED_STAGE), band: bool = False,
                         mechanisms: str = "nominal") -> list[dict]:
    """Each published row with a setup the model can describe, next to `predict` under `stages` (each row under
    its own setup: range ratio, prompts, token budget, sequences, KV dtype, page size). With `band`, the
    MEASURED_STAGE prediction's band (`predict(band=True)`: one-at-a-time extremes and the joint corners) and
    whether the measurement lies inside it."""

    rows = []
    for m in published()["measurements"]:
        if not m.get("compare"):
            continue
        row = dict(source=m["source"], setup=m["setup_label"], acceptance=bool(m.get("acceptance")),
                   isl=m["isl"], osl=m["osl"],
                   concurrency=m["concurrency"], measured_total_tokens_per_s=m["total_tokens_per_s"],
                   measured_output_tokens_per_s=m.get("output_tokens_per_s"),
                   measured_median_tpot_ms=m.get("median_tpot_ms"), measured_median_ttft_ms=m.get("median_ttft_ms"))
        setup = m.get("setup", {})
        mech = setup_mechanisms(setup) if mechanisms == "nominal" else mechanisms
        for st in stages:
            p = predict_as_run(m, st, mechanisms=mech, band=band and st == MEASURED_STAGE and mechanisms == "nominal")
            row[f"predicted_total_{st}"] = p["total_tokens_per_s"]
            row[f"ratio_{st}"] = p["total_tokens_per_s"] / m["total_tokens_per_s"]
            row[f"predicted_median_tpot_ms_{st}"] = p["median_tpot_s"] * 1e3
            if m.get("median_tpot_ms"):
                row[f"tpot_ratio_{st}"] = p["median_tpot_s"] * 1e3 / m["median_tpot_ms"]
            row[f"predicted_median_ttft_ms_{st}"] = p["median_ttft_s"] * 1e3
            if m.get("median_ttft_ms"):
                row[f"ttft_ratio_{st}"] = p["median_ttft_s"] * 1e3 / m["median_ttft_ms"]
            if "band" in p:
                lo, hi = p["band"]["total_tokens_per_s"]
                row["band_total_tokens_per_s"] = [lo, hi]
                row["inside_band"] = lo <= m["total_tokens_per_s"] <= hi
                row["band_median_tpot_ms"] = [v * 1e3 for v in p["band"]["median_tpot_s"]]
                if m.get("median_tpot_ms"):
                    tlo, thi = row["band_median_tpot_ms"]
                    row["tpot_inside_band"] = tlo <= m["median_tpot_ms"] <= thi
        rows.append(row)
    return rows


def predict_as_run(m: dict, stage: str, **kwargs) -> dict:
    """`predict` of published row `m` as it was run: its workload and concurrency, its setup's token budget,
    sequences, prompts, range ratio, KV dtype and page size, and (unless `kwargs` gives them) the mechanisms its
    setup switches name (`setup_mechanisms`); `stage` the plan it is priced under."""
    from qwen35_lib.costmodel.predict import predict

    setup = m.get("setup", {})
    kwargs.setdefault("mechanisms", setup_mechanisms(setup))
    return predict("qwen3.5-397b-a17b", "tpu7x-8", stage, m["isl"], m["osl"], m["concurrency"], roofline=False,
                   max_batched_tokens=setup.get("max_batched_tokens_per_rank"),
                   max_seqs=setup.get("max_seqs_per_rank"), num_prompts=setup.get("num_prompts"),
                   range_ratio=setup.get("range_ratio", 0.8), kv_dtype=setup.get("kv_dtype", "float8_e4m3fn"),
                   page_size=setup.get("page_size", 256), **kwargs)


def setup_mechanisms(setup: dict):
    """The nominal mechanisms under a published row's setup switches: tpu-inference's DP_SCHED_BATCH_PREFILL
    (`dp_sched_batch_prefill`, default true) and the server's --async-scheduling (`async_scheduling`, default true:
    every published server here ran with it)."""
    from qwen35_lib.costmodel.assumptions import Mechanisms

    return Mechanisms.nominal(dp_batch_prefill=setup.get("dp_sched_batch_prefill", True),
                              async_scheduling=setup.get("async_scheduling", True))


def ttft_points(stage: str = MEASURED_STAGE) -> list[dict]:
    """The published rows that give a median TTFT (`ttft`: true in data/published.json: tpu-recipes' DP8_EP runs,
    8k/1k and 1k/8k at 128 concurrent requests) predicted under their own setup and `stage` (the plan they ran):
    per row the predicted and published median TTFT, median TPOT and total tokens/s, each ratio (predicted /
    published) and whether it is within 25 %, and the published mean and p99 TTFT and median and p99 inter-token
    latencies beside them, the model's median and p99 inter-token latency in `predicted` (not judged: they say
    which steps the model prices apart from the run: decode-only steps set the median, prompt steps the p99)."""

    rows = []
    for m in published()["measurements"]:
        if not m.get("ttft"):
            continue
        setup = m["setup"]
        p = predict_as_run(m, stage)
        row = dict(source=m["source"], setup=m["setup_label"], isl=m["isl"], osl=m["osl"],
                   concurrency=m["concurrency"], async_scheduling=setup.get("async_scheduling", True),
                   published={k: m[k] for k in ("median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                "median_itl_ms", "p99_itl_ms", "total_tokens_per_s") if k in m},
                   predicted=dict(median_ttft_ms=p["median_ttft_s"] * 1e3, median_tpot_ms=p["median_tpot_s"] * 1e3,
                                  total_tokens_per_s=p["total_tokens_per_s"], mean_step_ms=p["mean_step_s"] * 1e3,
                                  median_itl_ms=p.get("median_itl_s", math.nan) * 1e3,
                                  p99_itl_ms=p.get("p99_itl_s", math.nan) * 1e3))
        for key in ("median_ttft_ms", "median_tpot_ms", "total_tokens_per_s"):
            ratio = row["predicted"][key] / m[key]
            row[f"{key}_ratio"] = ratio
            row[f"{key}_within_25pct"] = abs(ratio - 1) <= 0.25
        rows.append(row)
    return rows


def band_drivers(stage: str = MEASURED_STAGE) -> list[dict]:
    """Why the band is as wide as it is (issue 55, item 6): for each acceptance row of data/published.json (#3050,
    8k/1k, c64/128/256), `predict(band=True)` under the row's own setup and `stage`, and per row: `high_over_low`
    (the band's width), `by_assumption` {swept assumption: its own ends' total tokens/s, high over low}, largest
    first, and `corners` (the joint pessimistic and optimistic corners over the nominal)."""

    out = []
    for m in published()["measurements"]:
        if not m.get("acceptance"):
            continue
        p = predict_as_run(m, stage, band=True)
        ends: dict[str, list[float]] = {}
        for e in p["band"]["extremes"]:
            ends.setdefault(e["assumption"], []).append(e["total_tokens_per_s"])
        spread = {k: max(v) / min(v) for k, v in ends.items()}
        out.append(dict(concurrency=m["concurrency"], high_over_low=p["band"]["high_over_low"],
                        by_assumption=dict(sorted(spread.items(), key=lambda kv: -kv[1])),
                        corners={c["corner"]: c["total_tokens_per_s"] / p["total_tokens_per_s"]
                                 for c in p["band"]["corners"]}))
    return out


LAYOUT_OF_SETUP = {"DP4TP2_EP": "dp4_tp2_ep8", "TP8_EP": "tp8_ep8"}  # tpu-inference's presets (issue 55)


def layout_points(band: bool = False) -> list[dict]:
    """The published rows of the low-concurrency layouts (issue 55: tpu-inference #3050's DP4TP2_EP rows, #3116's
    TP8_EP rows; rows whose setup label names a preset of LAYOUT_OF_SETUP), each predicted as that engine runs the
    layout (`plan.TPU_INFERENCE_3050` with the preset's layout: its Pallas kernels, the packed all-gather, no
    hierarchical reduce-scatter) under the row's own setup, or else the setup of the same PR's rows that record one,
    with its rules at the layout's DP size (server.sh: batched tokens ISL / DP a rank, --max-num-seqs 64 a rank;
    bench.sh: 10 x CONC prompts). Per row the
    total tokens/s and median TPOT ratios (predicted / published) and whether each is within 25 %."""
    import dataclasses

    from qwen35_lib.costmodel.predict import predict
    from qwen35_lib.plan import TPU_INFERENCE_3050

    rows, doc = [], published()
    for m in doc["measurements"]:
        preset = next((k for k in LAYOUT_OF_SETUP if k in m.get("setup_label", "")), None)
        if preset is None:
            continue
        layout = LAYOUT_OF_SETUP[preset]
        plan = dataclasses.replace(TPU_INFERENCE_3050, layout=layout)
        plan = plan.replace(fuse_allgather=plan.collective_flags_apply)  # packed where the plan record's rule allows
        own = m.get("setup")  # a row's own setup; else the setup of its PR's rows, at its layout's DP size
        setup = own or next(x["setup"] for x in doc["measurements"] if x["source"] == m["source"] and x.get("setup"))
        dp = plan.on_devices(8).bind(_mesh8()).dp
        budget = setup["max_batched_tokens_per_rank"] if own else max(m["isl"] // dp, 1)
        p = predict("qwen3.5-397b-a17b", "tpu7x-8", plan, m["isl"], m["osl"], m["concurrency"], roofline=False,
                    max_batched_tokens=budget, max_seqs=setup.get("max_seqs_per_rank"),
                    num_prompts=10 * m["concurrency"], range_ratio=setup.get("range_ratio", 0.8),
                    kv_dtype=setup.get("kv_dtype", "float8_e4m3fn"), page_size=setup.get("page_size", 256),
                    mechanisms=setup_mechanisms(setup), band=band)
        row = dict(source=m["source"], setup=m["setup_label"], layout=layout, isl=m["isl"], osl=m["osl"],
                   concurrency=m["concurrency"], max_batched_tokens_per_rank=budget,
                   measured_total_tokens_per_s=m["total_tokens_per_s"],
                   predicted_total_tokens_per_s=p["total_tokens_per_s"],
                   ratio=p["total_tokens_per_s"] / m["total_tokens_per_s"],
                   predicted_median_tpot_ms=p["median_tpot_s"] * 1e3, measured_median_tpot_ms=m.get("median_tpot_ms"),
                   predicted_median_ttft_ms=p["median_ttft_s"] * 1e3, measured_median_ttft_ms=m.get("median_ttft_ms"))
        row["within_25pct"] = abs(row["ratio"] - 1) <= 0.25
        if m.get("median_tpot_ms"):
            row["tpot_ratio"] = row["predicted_median_tpot_ms"] / m["median_tpot_ms"]
            row["tpot_within_25pct"] = abs(row["tpot_ratio"] - 1) <= 0.25
        if m.get("median_ttft_ms"):
            row["ttft_ratio"] = row["predicted_median_ttft_ms"] / m["median_ttft_ms"]
            row["ttft_within_25pct"] = abs(row["ttft_ratio"] - 1) <= 0.25
        if band:
            row["band_total_tokens_per_s"] = p["band"]["total_tokens_per_s"]
        rows.append(row)
    return rows


def _mesh8():
    from qwen35_lib.plan import abstract_mesh

    return abstract_mesh(8)


MOE_SET_FROM = 1024  # the MoE layer's two derived constants are set from the cells with N <= this; the rest judge
MOE_DERIVED = ("moe_row_overhead_s", "moe_layer_fixed_s")  # the only figures of the model set from measured data


def moe_measured() -> dict:
    """data/moe_layer_measured.json (judging data; read only here)."""
    return data.read_json("moe_layer_measured.json")


def _moe_cells(part: dict | None = None) -> dict[int, tuple[float, float]]:
    """{N: (whole-layer seconds, grouped-matmul kernels' seconds)} of a set of cells (default: the recorded-routing
    cells of data/moe_layer_measured.json)."""
    part = part or moe_measured()
    return {int(n): (us * 1e-6, part["kernel_us"][n] * 1e-6) for n, us in part["cells_us"].items()}


def _outside_fit(u: dict[int, float], r: dict[int, float], k: int) -> tuple[float, float]:
    """(a, c) >= 0 minimising sum_i ((o_i + a + c N_i k) / u_i - 1)^2 given the residuals r_i = u_i - o_i: least
    squares on the relative error of the time outside the kernels; where the free solution has a < 0 or c < 0,
    that one is 0 and the other is solved alone."""
    ns = sorted(u)
    A = np.array([[1 / u[n], n * k / u[n]] for n in ns])
    y = np.array([r[n] / u[n] for n in ns])
    a, c = np.linalg.lstsq(A, y, rcond=None)[0] if len(ns) > 1 else (0.0, -1.0)
    if a < 0 or c < 0:
        one = [(A[:, 1], "c"), (A[:, 0], "a")] if a < 0 else [(A[:, 0], "a"), (A[:, 1], "c")]
        for col, name in one:
            v = max(0.0, float(col @ y / (col @ col)))
            if v > 0 or name == one[-1][1]:
                a, c = (0.0, v) if name == "c" else (v, 0.0)
                break
    return float(a), float(c)


def moe_row_overhead(cells: dict[int, tuple[float, float]] | None = None) -> dict:
    """The two constants of `moe_layer` set from measured data, from the cells with N <= MOE_SET_FROM (`cells`:
    {N: (whole-layer seconds, grouped-matmul kernels' seconds)}, default the recorded-routing cells): the time
    outside the kernels u_i = t_i - g_i (which does not depend on which experts the rows go to); with both
    constants 0 and every other assumption nominal, the model's time outside its grouped matmul o_i (the layer
    less `routed_experts`: permutes, collectives, top-k); r_i = N_i k routed rows;
    1. `moe_layer_fixed_s` a and `moe_row_overhead_s` c minimise sum_i ((o_i + a + c r_i) / u_i - 1)^2 (least
       squares on the relative error; neither below 0);
    2. low / high of each: the smallest and largest of the fits leaving one cell out (and the fit itself).
    Returns {"value", "low", "high" (moe_row_overhead_s), "fixed": {"value", "low", "high"} (moe_layer_fixed_s),
    "cells"}; data/costmodel_assumptions.json records the result."""
    from qwen35_lib.costmodel.assumptions import Mechanisms
    from qwen35_lib.costmodel.moe_layer import layer_time
    from qwen35_lib.costmodel.predict import serving_model

    cfg, sp = serving_model(), specs_lib.get("tpu7x-8")
    mech = Mechanisms.nominal(moe_row_overhead_s=0.0, moe_layer_fixed_s=0.0)
    cells = {n: tg for n, tg in (cells or _moe_cells()).items() if n <= MOE_SET_FROM}
    k = cfg.num_experts_per_tok
    u = {n: t - g for n, (t, g) in cells.items()}
    o = {}
    for n in cells:
        lt = layer_time(cfg, sp, n, mech)
        o[n] = lt.seconds - lt.breakdown["routed_experts"]
    r = {n: u[n] - o[n] for n in cells}
    a, c = _outside_fit(u, r, k)
    loo = [_outside_fit({n: u[n] for n in cells if n != m}, r, k) for m in cells] if len(cells) > 2 else []
    fa, fc = [a] + [x for x, _ in loo], [c] + [y for _, y in loo]
    return dict(value=c, low=min(fc), high=max(fc), fixed=dict(value=a, low=min(fa), high=max(fa)),
                cells=sorted(cells))


def _layer_rows(cfg: Config, cells: dict[int, tuple[float, float]], mech, role, **kwargs) -> list[dict]:
    """Per cell: N, the measured and modelled layer time (us), their ratio, within 25 %, `role(N)`, the model's
    components, and the grouped matmul apart: measured kernels vs the model's `routed_experts`, and the rest."""
    from qwen35_lib.costmodel.moe_layer import layer_time

    sp = specs_lib.get("tpu7x-8")
    rows = []
    for n, (t, g) in sorted(cells.items()):
        lt = layer_time(cfg, sp, n, mech, **kwargs)
        gm = lt.breakdown["routed_experts"]
        rows.append(dict(tokens=n, measured_us=t * 1e6, model_us=lt.seconds * 1e6, ratio=lt.seconds / t,
                         within_25pct=abs(lt.seconds / t - 1) <= 0.25, role=role(n),
                         kernel_us=g * 1e6, model_kernel_us=gm * 1e6, kernel_ratio=gm / g,
                         outside_ratio=(lt.seconds - gm) / (t - g),
                         breakdown_us={key: v * 1e6 for key, v in lt.breakdown.items() if v}))
    return rows


def moe_layer_comparison(mechanisms=None) -> list[dict]:
    """Per recorded-routing cell: N, the measured and modelled layer time (us), their ratio, the model's
    components, the grouped matmul apart (`_layer_rows`), and whether the cell set the derived constants or judges
    them. The recorded routing is skewed (evaluation traffic): fewer experts are touched at small N than the
    model's uniform count, so its grouped matmul is priced above these cells' kernels there."""
    from qwen35_lib.costmodel.assumptions import Mechanisms
    from qwen35_lib.costmodel.predict import serving_model

    role = lambda n: "sets " + ", ".join(MOE_DERIVED) if n <= MOE_SET_FROM else "judges"  # noqa: E731
    return _layer_rows(serving_model(), _moe_cells(), mechanisms or Mechanisms.nominal(), role)


def moe_random_routing_comparison(mechanisms=None) -> list[dict]:
    """`moe_layer_comparison` on the same shape's random-routing cells (data/moe_layer_measured.json
    `random_routing`: the routing the model's touched-expert count assumes); nothing is set from them."""
    from qwen35_lib.costmodel.assumptions import Mechanisms
    from qwen35_lib.costmodel.predict import serving_model

    return _layer_rows(serving_model(), _moe_cells(moe_measured()["random_routing"]),
                       mechanisms or Mechanisms.nominal(), lambda n: "judges (random routing)")


def second_shape_config() -> Config:
    """The benchmark's second shape (data/moe_layer_measured.json `second_shape`: Qwen3-30B-A3B's MoE, its widths,
    expert count, top-k and FP8 experts) as a `Config` the MoE layer model reads (`moe_layer.layer_time` reads only
    the MoE's fields; the rest is the 35B preset's and unused)."""
    from qwen35_lib.costmodel.predict import serving_model

    sh = moe_measured()["second_shape"]["shape"]
    return serving_model("qwen3.5-35b-a3b", hidden_size=sh["hidden"], moe_ffn=sh["intermediate"],
                         num_experts=sh["experts"], num_experts_per_tok=sh["top_k"], expert_dtype=sh["weight_dtype"])


def moe_second_shape_comparison(mechanisms=None) -> list[dict]:
    """`moe_layer_comparison` on the second shape, nothing set from it: each cell of `second_shape` next to
    `moe_layer.layer_time` of its config under the arm it ran (`second_shape.flags`: upstream defaults, so no one-hot
    permute, and `gathered=False`: no all-gathers, the combine's all-reduce), every assumption nominal."""
    from qwen35_lib.costmodel.assumptions import Mechanisms

    second = moe_measured()["second_shape"]
    mech = dataclasses.replace(mechanisms or Mechanisms.nominal(),
                               onehot_permute_threshold=second["flags"]["ONEHOT_MOE_PERMUTE_THRESHOLD"])
    return _layer_rows(second_shape_config(), _moe_cells(second), mech, lambda n: "judges (second shape)",
                       gathered=False)


def acceptance(rows: list[dict] | None = None, stage: str = MEASURED_STAGE) -> dict:
    """The acceptance figures on the fixed comparison set (tpu-inference #3050, 8k/1k, c64/128/256), each point
    predicted under its own recorded setup and the plan it ran (MEASURED_STAGE): per point the total tokens/s
    and median TPOT ratios, whether each is within 25 %, whether the published figures lie inside the printed
    band, and the trend |ratio(c256) / ratio(c64) - 1| (at most 0.15)."""
    rows = [r for r in (rows or published_comparison((stage,), band=True)) if r["acceptance"]]
    by_c = {r["concurrency"]: r for r in rows}
    pts = [dict(concurrency=c, ratio=r[f"ratio_{stage}"], tpot_ratio=r.get(f"tpot_ratio_{stage}"),
                predicted_median_ttft_ms=r.get(f"predicted_median_ttft_ms_{stage}"),
                measured_median_ttft_ms=r.get("measured_median_ttft_ms"), ttft_ratio=r.get(f"ttft_ratio_{stage}"),
                within_25pct=abs(r[f"ratio_{stage}"] - 1) <= 0.25,
                tpot_within_25pct=abs(r.get(f"tpot_ratio_{stage}", float("inf")) - 1) <= 0.25,
                inside_band=r.get("inside_band"), tpot_inside_band=r.get("tpot_inside_band"))
           for c, r in sorted(by_c.items())]
    lo, hi = min(by_c), max(by_c)
    trend = abs(by_c[hi][f"ratio_{stage}"] / by_c[lo][f"ratio_{stage}"] - 1)
    return dict(stage=stage, points=pts, trend=trend, trend_ok=trend <= 0.15,
                all_within_25pct=all(p["within_25pct"] and p["tpot_within_25pct"] for p in pts),
                all_inside_band=all(p["inside_band"] and p["tpot_inside_band"] for p in pts))


def notebook_data(concurrency: int = 512) -> dict:
    """Issue 13's results as one JSON-able dict: `comparison` (`published_comparison(band=True)`), `acceptance`,
    `explain` ({"8k/1k" | "1k/8k": `predict(explain=True, band=True)` of `kernels` at `concurrency`}) and `ladder`
    (`stage_ladder.ladder_explained`); a few minutes on 2 CPU cores."""
    from qwen35_lib.costmodel.predict import predict
    from qwen35_lib.costmodel.stage_ladder import ladder_explained

    rows = published_comparison(("kernels", MEASURED_STAGE), band=True)
    explain = {f"{i // 1024}k/{o // 1024}k": predict(stage="kernels", isl=i, osl=o, concurrency=concurrency,
                                                     roofline=False, explain=True, band=True)
               for i, o in ((8192, 1024), (1024, 8192))}
    return dict(comparison=rows, acceptance=acceptance(rows), explain=explain,
                ladder=ladder_explained(concurrency=concurrency, roofline=False))
