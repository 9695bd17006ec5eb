"""`python -m qwen35_lib.bench costmodel`: the cost model's three validations, as ratios (predicted / measured).

1. (a) CPU: the engine's step for `--model` (default qwen3.5-mini, float32) over batch sizes and prefill/decode
   mixes (`costmodel.validate.default_cases`), measured interleaved, against `step_time` with this CPU's measured
   specs (`costmodel.cpu_bench`);
2. (b) TPU7x ahead of time: `forward` compiled for tpu7x:2x2x1 at `--aot` sizes (model:layers:batch:seq; one
   layer group so XLA's while-loop counting does not halve its figures), XLA's FLOPs / bytes / argument bytes
   against the model's;
3. (c) published: data/published.json's comparable rows against `predict`, and the MoE layer sub-model against
   production's layer measured on TPU7x (data/moe_layer_measured.json);
4. the time a default `predict` with its band takes at 512 concurrency, for both workloads (wall seconds).
`--write-data` also writes the document to data/costmodel_validation.json, which notebook 06 shows.
"""

from __future__ import annotations

import argparse
import statistics

from qwen35_lib import data
from qwen35_lib.bench.timing import environment, format_table, warn_if_busy, write_json
from qwen35_lib.config import get_config

DESCRIPTION = "cost-model validations: CPU engine steps, TPU7x AOT cost/memory analysis, published figures"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3.5-mini", help="CPU model (default: %(default)s)")
    p.add_argument("--aot", default="qwen3.5-mini:4:2:64,qwen3.5-397b-a17b:4:1:16",
                   help="AOT compiles, model:layers:batch:seq, comma-separated ('' to skip; default: %(default)s)")
    p.add_argument("--write-data", action="store_true", help="also write data/costmodel_validation.json")


def predict_speed(concurrency: int = 512) -> dict[str, float]:
    """Wall seconds of a default `predict` with its band at `concurrency`, 8k/1k and 1k/8k (a fresh schedule each:
    the lockstep cache cleared first)."""
    import time

    from qwen35_lib.costmodel import lockstep, predict

    out = {}
    for isl, osl in ((8192, 1024), (1024, 8192)):
        lockstep.lockstep.cache_clear()
        t = time.perf_counter()
        predict(isl=isl, osl=osl, concurrency=concurrency, band=True)
        out[f"{isl // 1024}k/{osl // 1024}k"] = time.perf_counter() - t
    return out


def run(args: argparse.Namespace) -> dict:
    import qwen35_lib
    from qwen35_lib.aot import validate as aot_validate
    from qwen35_lib.costmodel import cpu_bench, validate

    load = warn_if_busy()
    specs = cpu_bench.measure()
    cfg = get_config(args.model, dtype="float32")
    rows = validate.cpu_engine_steps(cfg, qwen35_lib.init_weights(cfg, 0), repeats=args.repeats, cpu_specs=specs)
    print(format_table(["case", "D", "T", "measured ms", "predicted ms", "ratio"],
                       [[r["case"], r["D"], r["T"], r["measured_s"] * 1e3, r["predicted_s"] * 1e3, r["ratio"]]
                        for r in rows]))
    aot = []
    for spec in filter(None, args.aot.split(",")):
        name, layers, b, s = spec.split(":")
        aot.append(aot_validate.aot_forward_isolated(name, int(layers), int(b), int(s)))
    for r in aot:
        if "error" in r:
            print(f"AOT {r['model']} x{r['layers']}: {r['error']}")
    aot_ok = [r for r in aot if "error" not in r]
    if aot_ok:
        print(format_table(["model", "layers", "B x S", "flops ratio", "bytes ratio", "memory ratio", "compile s"],
                           [[r["model"], r["layers"], f"{r['batch']}x{r['seq']}", r["flops_ratio"], r["bytes_ratio"],
                             r["memory_ratio"], r["compile_s"]] for r in aot_ok]))
    pub = validate.published_comparison()
    m = validate.MEASURED_STAGE
    print(format_table(["source", "ISL/OSL", "conc", "measured tok/s", "fused_ag ratio", "kernels ratio",
                        f"{m} ratio"],
                       [[r["source"].rsplit("/", 1)[-1], f"{r['isl']}/{r['osl']}", r["concurrency"],
                         r["measured_total_tokens_per_s"], r["ratio_fused_ag"], r["ratio_kernels"], r[f"ratio_{m}"]]
                        for r in pub]))
    moe = validate.moe_layer_comparison()
    print(format_table(["MoE layer N", "measured us", "model us", "ratio", "role"],
                       [[r["tokens"], r["measured_us"], r["model_us"], r["ratio"], r["role"]] for r in moe]))
    speed = predict_speed()
    print(format_table(["predict (band) at c512", "wall s"], [[k, v] for k, v in speed.items()]))
    ratios = [r["ratio"] for r in rows]
    doc = dict(benchmark="costmodel", cpu_model=args.model, cpu_specs=specs, cpu_steps=rows,
               cpu_ratio_spread=[min(ratios), max(ratios)], cpu_ratio_median=statistics.median(ratios),
               aot=aot, published=pub, moe_layer=moe, predict_seconds=speed,
               environment=environment(loadavg_1m_before=load))
    if args.write_data:
        write_json(data.path("costmodel_validation.json"), doc)
    return doc
