"""`python -m qwen35_lib.bench engine`: the serving engine's throughput, TTFT and TPOT per workload and concurrency.

Closed loop: for each workload (`8k/1k`, `1k/8k`, `1k/1k`, lengths scaled at CPU size by one factor, default 1/16)
and each concurrency N, N requests are submitted at t = 0 (ignore_eos, so every output has its drawn length) and
run to completion. One `EngineConfig` per N, shared by every workload (so they share compiled steps), sized so
the N requests fit without preemption: max_num_seqs = N, pages for N requests of the longest workload, a token
budget scaled like the lengths (InferenceMAX's 8192 -> 512 at 1/16).

Compilation is kept out of the measurement: before each measured run, `Engine.precompile` compiles every bucket
the run will use (the scheduler run dry on the same requests), timed on its own ("compile"). The measured run's
trace count says whether this held (0); if not, the run is measured again, warm.

Where the time goes, per run: each step split into the jitted step (dispatch, device, tokens read back) and the
host (scheduling, packing, transfers in, bookkeeping), for decode and prefill steps; and the decode steps'
fraction of this machine's memory roofline: the bytes each must read (`bench.roofline.decode_bytes`) over the
copy bandwidth measured in the same run (a numpy copy), against their measured time.

Per component (`--profile-steps`, on by default): the run replayed under `jax.profiler` on a fresh engine, each
step's executable split by the model's named scopes into dense matmuls, attention, GDN, MoE, sampling and the
rest (`bench.profile`), decode and prefill steps apart, each component beside its floors (its least bytes over
the copy bandwidth, its FLOPs over the matmul peak, both measured in this run: `roofline.step_components`), with
the measured run's host time per step. The profiler's per-thunk cost inflates steps of many small ops (a decode step
of qwen3.5-mini: about 85 ms profiled against 48 ms measured), so the shares of small-op components read high there.

The routed experts by ablation (`--ablate-experts`, on by default): the same requests run once more with the
`moe_matmul` kernel replaced by one that returns zeros (`ZERO_EXPERTS`, routing kept), timed like the measured run;
the difference in jitted step time (p50, per step kind) is what the routed experts cost unprofiled. Where the
kernel fuses the dispatch and combine (`fuses`: the CPU's `native` kernel at every size, `loop` at prefill sizes),
the zero kernel fuses them too and the difference counts all three; elsewhere the permute slot's dispatch and
combine stay and the difference is the grouped matmul alone.

Load: each measured run and the comparison record the load average before and after, this process's CPU share
and the other processes' mean cores (`timing.BusyMonitor`); every ratio (decode scaling, ours / transformers) is
withheld, with the reason printed, when the load before was above the core count or others held the cores.

`--vs-transformers` (on when transformers is installed): the same random weights in both (the HF twin of the
preset, saved and loaded with `load_hf_checkpoint`, float32 on both sides), 8 requests of the scaled 1k/1k
workload: our engine (greedy) vs transformers' `generate` on one left-padded batch (greedy, eager, KV/state
cache), timed interleaved; the greedy tokens compared request by request. Each timed call is a whole generation
(seconds long), so `--settle` is not used here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import numpy as np

from qwen35_lib.bench import workloads as wl
from qwen35_lib.bench.timing import (
    BusyMonitor,
    environment,
    format_table,
    measure,
    native_isa_text,
    progress,
    ratio_text,
    warn_if_busy,
    xla_cpu_threads,
)
from qwen35_lib.config import Config, get_config
from qwen35_lib.plan import SINGLE, ServingPlan

DESCRIPTION = ("serving throughput, TTFT, TPOT of the engine per workload and concurrency (closed loop); "
               "decode vs transformers' generate")
DEFAULTS = dict(model="qwen3.5-mini", concurrency="1,8,64", workloads="8k/1k,1k/8k,1k/1k", scale=None,
                vs_requests=8)
QUICK = dict(model="qwen3.5-tiny", concurrency="1,2", workloads="1k/1k", scale="1/64", vs_requests=2)
DECODE_TARGET = 4.0  # decode tokens/s at the largest concurrency over that at 1
VS_TARGET = 2.0  # our output tokens/s over transformers' at `vs_requests`
PAGE_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"a Qwen3.5 preset (default: {DEFAULTS['model']}; --quick: {QUICK['model']})")
    p.add_argument("--dtype", default="float32", help="weights and activations (default: %(default)s)")
    p.add_argument("--concurrency", help=f"requests in flight, comma-separated (default: {DEFAULTS['concurrency']})")
    p.add_argument("--workloads", help=f"workload names (default: {DEFAULTS['workloads']})")
    p.add_argument("--scale", help="length scale factor for both input and output (default: data/workloads.json "
                   f"cpu_scale, {wl.cpu_scale()}; --quick: {QUICK['scale']})")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="engine token budget per step (default: the published 8192 times --scale, at least one chunk)")
    p.add_argument("--page-size", type=int, default=PAGE_SIZE, help="KV-cache page size (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the requests and the weights")
    p.add_argument("--plot", metavar="PATH", help="the figure (default: next to --json, .png)")
    p.add_argument("--vs-transformers", action=argparse.BooleanOptionalAction, default=None,
                   help="also compare with transformers' generate (default: when transformers is installed)")
    p.add_argument("--vs-requests", type=int, help=f"requests in the comparison (default: {DEFAULTS['vs_requests']})")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--moe-kernel", default="auto", help="our moe_matmul implementation (default: %(default)s: the "
                   "backend's, `native` on CPU)")
    p.add_argument("--profile-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="replay each run under jax.profiler: time per component beside its floor (default: on)")
    p.add_argument("--ablate-experts", action=argparse.BooleanOptionalAction, default=True,
                   help="run each workload again with the routed experts' grouped matmul replaced by zeros: what it "
                        "costs per step kind, unprofiled (default: on)")
    p.add_argument("--quick", action="store_true",
                   help="a small end-to-end run (tiny model, concurrency 1,2, 1k/1k at 1/64, one repeat)")


# --- the engine under a closed loop ---------------------------------------------------------------------------


@dataclasses.dataclass
class StepLog:
    """What each engine step did and how long it took (seconds)."""

    wall: list[float] = dataclasses.field(default_factory=list)  # the whole `engine.step()` call
    device: list[float] = dataclasses.field(default_factory=list)  # the jitted step, until its tokens are ready
    tokens: list[int] = dataclasses.field(default_factory=list)  # new tokens fed (decodes + prefill chunks)
    decode_only: list[bool] = dataclasses.field(default_factory=list)  # every sequence fed one token and sampled
    traced: list[int] = dataclasses.field(default_factory=list)  # compilations during the step
    contexts: list[list[int]] = dataclasses.field(default_factory=list)  # per step, each sequence's context after it
    cpu_share: float | None = None  # this process's CPU seconds / (wall seconds x cores): low = others competed
    loadavg: float | None = None  # 1-minute load average at the end


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run_requests(config: Config, weights: dict, ec, requests: list[tuple[list[int], int]], desc: str,
                 plan: ServingPlan = SINGLE):
    """Submit every request at once, step the engine until all are done; returns (engine, StepLog, wall seconds).

    A tqdm bar on stderr counts output tokens.
    """
    from qwen35_lib.engine import Engine, SamplingParams

    engine = Engine(config, weights, ec, plan=plan)
    log = StepLog()
    cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
    with progress(sum(o for _, o in requests), desc) as bar:
        for prompt, out in requests:
            engine.add_request(prompt, SamplingParams(max_new_tokens=out, ignore_eos=True))
        while engine.has_work:
            contexts = [r.computed + 1 for sched in engine.ranks for r in sched.running]  # if it decodes them all
            traces, start = engine.stats.traces, time.perf_counter()
            events = engine.step()
            log.contexts.append(contexts)
            log.wall.append(time.perf_counter() - start)
            fed, seqs = engine.stats.tokens[-1], engine.stats.seqs[-1]
            log.tokens.append(fed)
            log.decode_only.append(fed == seqs == len(events))
            log.traced.append(engine.stats.traces - traces)
            bar.update(len(events))
    log.device = list(engine.stats.step_seconds)
    log.cpu_share = (_cpu_seconds() - cpu_start) / ((time.perf_counter() - wall_start) * (os.cpu_count() or 1))
    log.loadavg = _loadavg()
    results = list(engine.results.values())
    wall = max(r.token_times[-1] for r in results) - min(r.arrival for r in results)
    return engine, log, wall


def _percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    return {"p50": float(np.percentile(values, 50)) * scale, "p99": float(np.percentile(values, 99)) * scale}


def step_split(log: StepLog, steps: list[int]) -> dict | None:
    """Per step (p50 and mean, ms): the whole `engine.step()`, the jitted step in it (dispatch, the device,
    its tokens read back: `Engine.stats.step_seconds`), and the host rest (scheduling, packing, transfers in,
    sampling bookkeeping)."""
    if not steps or not log.device:
        return None
    wall = np.array([log.wall[i] for i in steps]) * 1e3
    jitted = np.array([log.device[i] for i in steps]) * 1e3
    host = wall - jitted
    stat = lambda a: {"p50": float(np.median(a)), "mean": float(np.mean(a))}
    return {"steps": len(steps), "wall_ms": stat(wall), "jitted_ms": stat(jitted), "host_ms": stat(host),
            "host_fraction": float(host.sum() / wall.sum())}


def decode_roofline(config: Config, log: StepLog, steps: list[int], bandwidth: float | None) -> dict | None:
    """The decode steps' fraction of the memory roofline: Σ (bytes each must read / `bandwidth`) over Σ their
    measured time (the jitted step, and the whole step), with the mean bytes per step and their parts."""
    from qwen35_lib.bench.roofline import decode_bytes

    if not steps or not bandwidth or not log.device:
        return None
    parts = [decode_bytes(config, log.contexts[i]) for i in steps]
    need = sum(p["total"] for p in parts) / bandwidth
    return {"bandwidth_gb_s": bandwidth / 1e9, "mean_bytes_per_step": float(np.mean([p["total"] for p in parts])),
            "mean_bytes_by_part": {k: float(np.mean([p[k] for p in parts])) for k in parts[0] if k != "total"},
            "roofline_ms_per_step": 1e3 * need / len(steps),
            "fraction_of_jitted": need / sum(log.device[i] for i in steps),
            "fraction_of_step": need / sum(log.wall[i] for i in steps)}


def metrics(engine, log: StepLog, wall: float, bandwidth: float | None = None) -> dict:
    """Throughput, latency percentiles and where the time went, for one finished closed-loop run."""
    results = list(engine.results.values())
    out_tokens = sum(len(r.output_ids) for r in results)
    in_tokens = sum(len(r.prompt_ids) for r in results)
    dec = [i for i, d in enumerate(log.decode_only) if d]
    pre = [i for i, d in enumerate(log.decode_only) if not d]
    dec_time = sum(log.wall[i] for i in dec)
    step_time, device_time = sum(log.wall), sum(log.device) if log.device else None
    return {
        "requests": len(results),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (in_tokens + out_tokens) / wall,
        "ttft_ms": _percentiles([r.ttft for r in results]),
        "tpot_ms": _percentiles([r.tpot for r in results]),
        "steps": engine.stats.steps,
        "mean_tokens_per_step": float(np.mean(log.tokens)),
        "mean_seqs_per_step": float(np.mean(engine.stats.seqs)),
        "decode_steps": len(dec),
        "prefill_steps": len(pre),
        "mixed_steps": engine.stats.mixed_steps,
        "decode_tokens_per_s": sum(log.tokens[i] for i in dec) / dec_time if dec_time else None,
        "decode_step_ms": _percentiles([log.wall[i] for i in dec]) if dec else None,
        "prefill_tokens_per_s": sum(log.tokens[i] for i in pre) / sum(log.wall[i] for i in pre) if pre else None,
        "time_s": {"prefill_steps": sum(log.wall[i] for i in pre), "decode_steps": dec_time,
                   "device": device_time, "host_in_steps": step_time - device_time if device_time else None,
                   "outside_steps": wall - step_time},
        "per_step": {"decode": step_split(log, dec), "prefill": step_split(log, pre)},
        "decode_roofline": decode_roofline(engine.config, log, dec, bandwidth),
        "preemptions": engine.preemptions,
        "recomputed_tokens": sum(engine.stats.recomputed),  # computed again after a preemption
        "waste": engine.stats.waste,  # recomputed over useful (computed once) tokens
        "cpu_share": log.cpu_share,
        "loadavg_1m_after": log.loadavg,
        "traces": engine.stats.traces,
        "buckets": sorted(list(b) for b in engine.stats.buckets),
    }


def engine_config(n: int, max_model_len: int, budget: int, page_size: int):
    """Knobs under which n requests of up to max_model_len tokens run together without preemption."""
    from qwen35_lib.engine import EngineConfig

    return EngineConfig(max_num_seqs=n, max_num_batched_tokens=budget, page_size=page_size, num_pages=None,
                        max_model_len=max_model_len)


def knobs(config: Config, ec) -> dict:
    from qwen35_lib.engine.cache import cache_bytes

    shape = ec.cache_shape()
    return {"max_num_seqs": ec.max_num_seqs, "max_num_batched_tokens": ec.max_num_batched_tokens,
            "page_size": ec.page_size, "num_pages": ec.pages, "max_model_len": ec.max_model_len, "ranks": ec.ranks,
            "cache_mib": cache_bytes(config, shape) / 2**20}


def measure_run(config: Config, weights: dict, ec, requests, label: str, machine: dict | None = None,
                profile: bool = True, plan: ServingPlan = SINGLE) -> dict:
    """Compile every bucket the run will use (`Engine.precompile`, timed on its own), then the measured run
    (again if it still compiled something), then (`profile`, with the `machine`'s floors) the profiled replay."""
    from qwen35_lib.engine import Engine

    start = time.perf_counter()
    info = Engine(config, weights, ec, plan=plan).precompile([len(p) for p, _ in requests],
                                                             [o for _, o in requests])
    compile_info = {"wall_s": time.perf_counter() - start, "buckets": [list(b) for b in info["buckets"]],
                    "traces": info["compiled"], "compile_steps_s": info["seconds"]}
    with BusyMonitor() as monitor:
        engine, log, wall = run_requests(config, weights, ec, requests, label, plan)
    remeasured = engine.stats.traces > 0
    if remeasured:
        print(f"note: {label}: the measured run compiled {engine.stats.traces} step(s) precompile did not; "
              "measuring again", file=sys.stderr)
        with BusyMonitor() as monitor:
            engine, log, wall = run_requests(config, weights, ec, requests, f"{label} again", plan)
    m = metrics(engine, log, wall, machine["copy_bandwidth_gb_s"] * 1e9 if machine else None)
    m |= {"compile": compile_info, "remeasured": remeasured, "load": monitor.result()}
    if profile and machine:
        host = {k: v["host_ms"]["mean"] for k, v in m["per_step"].items() if v}
        m["profile"] = profile_run(config, weights, ec, requests, machine, host, plan)
    return m


def profile_run(config: Config, weights: dict, ec, requests, machine: dict, host_ms: dict,
                plan: ServingPlan = SINGLE) -> dict:
    """Where each step kind's time goes (`bench.profile`): the run replayed under `jax.profiler` on a fresh engine
    (the same requests and compiled buckets), each step's executable split into components by the named scopes
    of its ops, beside each component's floors (`roofline.step_components` of the step's own tokens and
    contexts, over the bandwidth and matmul peak measured in this run); `host_ms` per kind from the measured run.

    1. Wrap the engine's step function to record each step's bucket, new tokens and contexts (host arrays);
    2. trace the whole run; match the step executions (in start order) to the recorded steps;
    3. per bucket, the op_name of every instruction from its compiled HLO (compiled already: a cache hit);
    4. per kind (decode: every sequence fed one token; prefill: the rest), `profile.summarize`.
    """
    from qwen35_lib.bench import profile as prof
    from qwen35_lib.bench.roofline import component_floors, step_components
    from qwen35_lib.engine import Engine, SamplingParams
    from qwen35_lib.engine.engine import engine_step
    from qwen35_lib.model.layer_loop import prepare_weights

    engine = Engine(config, weights, ec, plan=plan)
    steps: list[dict] = []
    first_args: dict[tuple, tuple] = {}

    def recording_step(cfg, plan, w, cache, tokens, meta, samp):
        q, kv = np.asarray(meta.q_len).ravel(), np.asarray(meta.kv_len).ravel()
        bucket_key = (int(np.shape(meta.decode_seq)[-1]), int(np.shape(tokens)[-1]))
        first_args.setdefault(bucket_key, (tokens, meta, samp))
        steps.append({"bucket": bucket_key, "q": q, "kv": kv, "decode": bool(np.all(q[q > 0] == 1))})
        return engine_step(cfg, plan, w, cache, tokens, meta, samp)

    engine.step_fn = recording_step  # no `lower`: the memory check is skipped (it ran in the measured run)

    def run():
        for prompt, out in requests:
            engine.add_request(prompt, SamplingParams(max_new_tokens=out, ignore_eos=True))
        while engine.has_work:
            engine.step()

    lines = prof.trace(run, calls=1)
    pw = prepare_weights(engine.config, weights, engine.plan)
    lower = lambda args: engine_step.lower(engine.config, engine.plan, pw, engine.cache, *args)
    names = {b: prof.op_names(lower(args).compile().as_text()) for b, args in first_args.items()}
    module = "jit_engine_step"
    order = prof.execution_order(lines, module)
    if len(order) != len(steps):
        return {"error": f"{len(order)} step executions traced for {len(steps)} steps; no profile"}
    bucket_of = {rid: s["bucket"] for rid, s in zip(order, steps)}
    per_run = prof.component_times(lines, lambda rid: names.get(bucket_of.get(rid), {}), module)
    walls = prof.execution_walls(lines, module)
    bw, peak = machine["copy_bandwidth_gb_s"] * 1e9, machine["matmul_gflop_s"] * 1e9
    out = {"method": prof.__doc__.splitlines()[0], "profiled_steps": len(steps)}
    for kind in ("decode", "prefill"):
        idx = [i for i, s in enumerate(steps) if s["decode"] == (kind == "decode")]
        if not idx:
            continue
        floors = [component_floors(step_components(config, steps[i]["q"], steps[i]["kv"],
                                                   int(np.sum(steps[i]["q"] > 0))), bw, peak) for i in idx]
        runs = [order[i] for i in idx]
        out[kind] = prof.summarize(per_run, runs, floors, walls, host_ms.get(kind))
        out[kind]["top_ops"] = prof.top_ops(lines, lambda rid: names.get(bucket_of.get(rid), {}), module, runs)
    return out


# --- vs transformers -------------------------------------------------------------------------------------------


def hf_twin(config: Config, seed: int) -> tuple[Any, Config, dict]:
    """(the seeded random HF model of `config`, and our (config, float32 weights) loaded from its checkpoint).

    The same construction as `vs-transformers`: `make_hf_model` with `hf_fields(config)`, `save_pretrained`,
    `load_hf_checkpoint`, and a check that the loaded config is the preset's architecture.
    """
    from qwen35_lib.bench.vs_transformers import check_same_model, hf_fields
    from qwen35_lib.checkpoint import load_hf_checkpoint
    from qwen35_lib.testing import make_hf_model

    hf = make_hf_model("qwen3_5_moe", seed=seed, dtype="float32", **hf_fields(config))
    with tempfile.TemporaryDirectory(prefix="qwen35_bench_") as tmp:
        hf.save_pretrained(tmp)
        ours, weights = load_hf_checkpoint(tmp, dtype="float32")
    check_same_model(config, ours)
    return hf, ours, weights


def _reference_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_generate(hf, requests: list[tuple[list[int], int]]) -> Any:
    """transformers' greedy `generate` on one left-padded batch, max_new_tokens = the longest output, EOS off.

    Returns the generated ids [B, max_new] (torch)."""
    import torch

    B, L = len(requests), max(len(p) for p, _ in requests)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, (p, _) in enumerate(requests):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(o for _, o in requests),
                          do_sample=False, pad_token_id=0)
    return out[:, L:]


def compare_with_transformers(hf, config: Config, weights: dict, ec, requests, repeats: int,
                              plan: ServingPlan = SINGLE) -> dict:
    """Our engine vs transformers' generate on the same requests, timed interleaved; greedy tokens compared."""
    import torch
    import transformers

    from qwen35_lib.engine import Engine, SamplingParams

    hf.generation_config.eos_token_id = None  # ignore_eos on both sides: exact lengths
    n_out = sum(o for _, o in requests)
    hf_new = max(o for _, o in requests)

    start = time.perf_counter()
    info = Engine(config, weights, ec, plan=plan).precompile([len(p) for p, _ in requests],
                                                             [o for _, o in requests])
    compile_s = time.perf_counter() - start

    def ours():
        results = Engine(config, weights, ec, plan=plan).generate(
            [p for p, _ in requests], [SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in requests])
        return [r.output_ids for r in results]

    with BusyMonitor() as monitor:
        timings, outputs = measure({"ours": ours, "transformers": lambda: hf_generate(hf, requests)},
                                   repeats=repeats, warmup=1, settle=0,
                                   desc=f"vs transformers, {len(requests)} requests")
    hf_ids = outputs["transformers"].tolist()
    same_prefix = []
    for mine, theirs, (_, o) in zip(outputs["ours"], hf_ids, requests):
        k = next((i for i, (a, b) in enumerate(zip(mine, theirs[:o])) if a != b), o)
        same_prefix.append(k)
    t_ours, t_hf = timings["ours"].median, timings["transformers"].median
    tps = {"ours": n_out / t_ours, "transformers": len(requests) * hf_new / t_hf,
           "transformers_useful": n_out / t_hf}
    return {
        "requests": len(requests),
        "prompt_lengths": [len(p) for p, _ in requests],
        "output_lengths": [o for _, o in requests],
        "dtype": "float32",
        "transformers": {"version": transformers.__version__, "torch": torch.__version__,
                         "threads": torch.get_num_threads(), "mode": "generate, greedy, left-padded batch, "
                         f"max_new_tokens={hf_new} for every row, eager, torch.no_grad, KV/state cache",
                         "attention": hf.config._attn_implementation,
                         "experts": getattr(hf.config, "_experts_implementation", None)},
        "ours": {"engine": knobs(config, ec), "moe_kernel": _moe_kernel(plan), "threads": xla_cpu_threads(),
                 "precompile": {"seconds": compile_s, "buckets": len(info["buckets"]), "traces": info["compiled"]}},
        "timings": {n: t.to_json() for n, t in timings.items()},
        "output_tokens_per_s": tps,
        "speedup": tps["ours"] / tps["transformers"],
        "speedup_useful": tps["ours"] / tps["transformers_useful"],
        "load": monitor.result(),
        "target": VS_TARGET,
        "greedy_match": {"requests_identical": sum(k == o for k, (_, o) in zip(same_prefix, requests)),
                         "first_32_identical": sum(k >= min(32, o) for k, (_, o) in zip(same_prefix, requests)),
                         "tokens_before_first_difference": same_prefix,
                         "tokens_compared": n_out},
    }


def _moe_kernel(plan: ServingPlan) -> str:
    return plan.kernel("moe_matmul")


# --- the benchmark ---------------------------------------------------------------------------------------------


def _resolve(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else DEFAULTS
    r = {k: getattr(args, k, None) if getattr(args, k, None) is not None else v for k, v in base.items()}
    r["scale"] = r["scale"] or wl.cpu_scale()
    try:
        r["concurrency"] = sorted({int(c) for c in str(r["concurrency"]).split(",") if c.strip()})
    except ValueError:
        raise ValueError(f"--concurrency {r['concurrency']!r}: give request counts like 1,8,64") from None
    if not r["concurrency"] or min(r["concurrency"]) < 1 or r["vs_requests"] < 1:
        raise ValueError("--concurrency and --vs-requests need positive request counts, e.g. --concurrency 1,8,64")
    r["workloads"] = wl.parse_names(r["workloads"])
    r["repeats"] = 1 if args.quick else args.repeats
    return r


def run(args: argparse.Namespace) -> dict:
    """1. Resolve the options; build the weights (the HF twin's when comparing with transformers, else seeded
       random ones); one EngineConfig per concurrency.
    2. For each concurrency and workload: draw the requests, warm up, measure (progress bars on stderr).
    3. Optionally compare with transformers' generate.
    4. Print the tables and ratios; plot; return the JSON document.
    """
    from qwen35_lib.weights import init_weights

    opts = _resolve(args)
    vs = args.vs_transformers
    if vs is None:
        vs = _reference_available()
    elif vs and not _reference_available():
        raise ValueError("--vs-transformers needs the 'reference' extra (torch, transformers); install with: "
                         "pip install -e '.[reference]'")
    load_before = warn_if_busy()
    preset = get_config(opts["model"], dtype=args.dtype)
    plan = SINGLE.replace(moe_kernel=args.moe_kernel)  # "auto": the platform's default
    machine = measure_machine()
    hf = None
    if vs:
        import torch

        torch.set_num_threads(args.threads)
        if args.dtype != "float32":
            raise ValueError(f"the comparison with transformers runs float32; pass --no-vs-transformers for --dtype "
                             f"{args.dtype}")
        hf, _, weights = hf_twin(get_config(opts["model"]), args.seed)
        config = preset  # hf_twin checked the loaded config is the preset's architecture: the same compiled steps
    else:
        config = preset
        weights = init_weights(config, args.seed)
    scale = str(wl.parse_factor(opts["scale"]))
    loads = {name: wl.scaled(name, scale) for name in opts["workloads"]}
    max_len = max(w.max_len for w in loads.values())
    budget = args.max_num_batched_tokens or max(config.gdn_chunk_size,
                                                round(wl.max_num_batched_tokens() * wl.parse_factor(scale)))
    configs = {n: engine_config(n, max_len, budget, args.page_size) for n in opts["concurrency"]}
    print(f"engine benchmark: {config.name} ({'the HF twin, ' if vs else ''}random weights, seed {args.seed}), "
          f"{config.dtype}, moe_matmul={_moe_kernel(plan)}, native kernels {native_isa_text()}; lengths x{scale}: "
          + ", ".join(f"{n} -> {w.input_len}/{w.output_len}" for n, w in loads.items())
          + f" (each uniform in [{next(iter(loads.values())).range_ratio} L, L]); closed loop, all N requests at t=0, "
          "ignore_eos")
    print(format_table(["N", "max_num_seqs", "max_num_batched_tokens", "page_size", "num_pages", "max_model_len",
                        "cache MiB"], [[n, *[knobs(config, ec)[k] for k in ("max_num_seqs", "max_num_batched_tokens",
                                        "page_size", "num_pages", "max_model_len", "cache_mib")]]
                                       for n, ec in configs.items()]))
    sys.stdout.flush()

    runs = []
    for n, ec in configs.items():
        for name, w in loads.items():
            requests = wl.draw_requests(w, n, args.seed, config.vocab_size)
            m = measure_run(config, weights, ec, requests, f"{name} N={n}", machine, profile=args.profile_steps,
                            plan=plan)
            if args.ablate_experts:
                m["ablation"] = ablate_experts(config, weights, ec, requests, f"{name} N={n}", m, plan)
            runs.append({"workload": name, "concurrency": n} | m)
    _print_runs(runs)
    _print_profiles(runs)
    _print_ablations(runs)
    scaling = decode_scaling(runs)

    comparison = None
    if vs:
        name = "1k/1k"
        w = wl.scaled(name, scale)
        n = opts["vs_requests"]
        ec = configs.get(n) or engine_config(n, max(max_len, w.max_len), budget, args.page_size)  # shared compiles
        comparison = compare_with_transformers(hf, config, weights, ec, wl.draw_requests(w, n, args.seed,
                                               config.vocab_size), opts["repeats"], plan) | {"workload": name}
        _print_comparison(comparison)

    doc = {
        "benchmark": "engine",
        "model": config.name,
        "dtype": config.dtype,
        "weights": "HF twin (make_hf_model), loaded with load_hf_checkpoint" if vs else "init_weights",
        "seed": args.seed,
        "moe_kernel": _moe_kernel(plan),
        "scale": scale,
        "workloads": {name: w.to_json() for name, w in loads.items()},
        "concurrency": opts["concurrency"],
        "engine_configs": {str(n): knobs(config, ec) for n, ec in configs.items()},
        "loop": "closed: all N requests submitted at t=0, run to completion, ignore_eos",
        "compile": "Engine.precompile of the buckets the run uses (the scheduler run dry), before each measured run",
        "machine": machine,
        "runs": runs,
        "decode_scaling": scaling,
        "vs_transformers": comparison,
        "environment": environment(loadavg_1m_before=load_before),
    }
    plot_path = pathlib.Path(args.plot) if args.plot else pathlib.Path(args.json).with_suffix(".png")
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot_results(doc).savefig(plot_path, dpi=110)
    doc["plot"] = str(plot_path)
    print(f"wrote {plot_path}", file=sys.stderr)
    return doc


def measure_machine() -> dict:
    """This machine's rooflines, measured now (`bench.roofline`): copy bandwidth and XLA:CPU matmul FLOP/s."""
    from qwen35_lib.bench.roofline import copy_bandwidth, matmul_flops

    bw, flops = copy_bandwidth(), matmul_flops()
    print(f"this machine now: numpy copy {bw / 1e9:.1f} GB/s (read + write), XLA:CPU float32 matmul "
          f"{flops / 1e9:.1f} GFLOP/s")
    return {"copy_bandwidth_gb_s": bw / 1e9, "matmul_gflop_s": flops / 1e9,
            "copy": "numpy copy of 256 MiB float32, best of 5, bytes read + written per second",
            "matmul": "jitted float32 1024x1024x1024, best of 5"}


def decode_scaling(runs: list[dict]) -> dict | None:
    """Decode tokens/s at the largest concurrency over that at the smallest, per workload (target: 4x, 64 vs 1)."""
    out = {}
    for name in dict.fromkeys(r["workload"] for r in runs):
        rs = sorted((r for r in runs if r["workload"] == name), key=lambda r: r["concurrency"])
        lo, hi = rs[0], rs[-1]
        if lo is hi or not lo["decode_tokens_per_s"] or not hi["decode_tokens_per_s"]:
            continue
        out[name] = {"low": lo["concurrency"], "high": hi["concurrency"],
                     "decode_tokens_per_s": [lo["decode_tokens_per_s"], hi["decode_tokens_per_s"]],
                     "ratio": hi["decode_tokens_per_s"] / lo["decode_tokens_per_s"],
                     "output_tokens_per_s_ratio": hi["output_tokens_per_s"] / lo["output_tokens_per_s"],
                     "withheld": next((r["load"]["withhold_ratios"] for r in (lo, hi)
                                       if r.get("load", {}).get("withhold_ratios")), None),
                     "target": DECODE_TARGET}
    if not out:
        return None
    print("\ndecode tokens/s (pure decode steps) at the largest concurrency over the smallest "
          f"(target >= {DECODE_TARGET:g}x at 64 vs 1):")
    print(format_table(["workload", "N", "decode tok/s", "ratio", "output tok/s ratio"],
                       [[k, f"{v['high']} vs {v['low']}", f"{v['decode_tokens_per_s'][1]:,.1f} vs "
                         f"{v['decode_tokens_per_s'][0]:,.1f}", "withheld" if v["withheld"] else f"{v['ratio']:.2f}x",
                         "withheld" if v["withheld"] else f"{v['output_tokens_per_s_ratio']:.2f}x"]
                        for k, v in out.items()]))
    for k, v in out.items():
        if v["withheld"]:
            print(f"{k}: ratios withheld: {v['withheld']}")
    return out


ZERO_EXPERTS = "bench_zero_experts"  # the ablation's moe_matmul: zeros, registered for the ablated run only


def zero_experts(kernel):
    """A `moe_matmul` that computes nothing (y_sorted = 0 [N, D]) and fuses the dispatch and combine where `kernel`
    does (then the routed experts' output is 0 [T, D], with no dispatch or combine either)."""
    import jax.numpy as jnp

    def zeros(x, group_sizes, w_gate_up, w_down, fp8_block=None):
        return jnp.zeros_like(x)

    if hasattr(kernel, "fuses"):
        zeros.fuses = kernel.fuses
        zeros.fused = lambda x, ids, weights, num_groups, w_gate_up, w_down, fp8_block=None: jnp.zeros_like(x)
    return zeros


def ablate_experts(config: Config, weights: dict, ec, requests, label: str, measured: dict,
                   plan: ServingPlan = SINGLE) -> dict:
    """The run again with the grouped matmul replaced by zeros (`ZERO_EXPERTS`, fusing where the plan's kernel
    fuses): per step kind, the jitted step's p50 with and without it, the difference and its share of the step
    (`measured`: the run's `metrics`)."""
    from qwen35_lib.kernels import registry

    kernel = registry.get("moe_matmul", plan.kernel("moe_matmul"))
    with registry.registered("moe_matmul", ZERO_EXPERTS, zero_experts(kernel)):
        zero = measure_run(config, weights, ec, requests, f"{label} zero experts", profile=False,
                           plan=plan.replace(moe_kernel=ZERO_EXPERTS))
    out = {"load": zero["load"]}
    for kind, split in measured["per_step"].items():
        other = zero["per_step"].get(kind)
        if not split or not other:
            continue
        with_ms, without_ms = split["jitted_ms"]["p50"], other["jitted_ms"]["p50"]
        out[kind] = {"with_ms": with_ms, "without_ms": without_ms, "experts_ms": with_ms - without_ms,
                     "share": (with_ms - without_ms) / with_ms}
    return out


def _print_ablations(runs: list[dict]) -> None:
    rows = [[r["workload"], r["concurrency"], kind, f"{a[kind]['with_ms']:,.1f}", f"{a[kind]['without_ms']:,.1f}",
             f"{a[kind]['experts_ms']:,.1f}", f"{100 * a[kind]['share']:.0f}%"]
            for r in runs if (a := r.get("ablation")) for kind in ("decode", "prefill") if kind in a]
    if not rows:
        return
    print("\nthe routed experts by ablation (jitted step p50 with them, and with a kernel returning zeros in the "
          "grouped matmul's place; routing kept; the dispatch and combine too where the kernel does not fuse them):")
    print(format_table(["workload", "N", "steps", "step ms", "zero experts ms", "experts ms", "share"], rows))
    sys.stdout.flush()


def _print_runs(runs: list[dict]) -> None:
    ms = lambda d, k: f"{d[k]['p50']:,.0f} / {d[k]['p99']:,.0f}"
    rows = [[r["workload"], r["concurrency"], r["output_tokens_per_s"], r["total_tokens_per_s"], ms(r, "ttft_ms"),
             ms(r, "tpot_ms"), r["decode_tokens_per_s"] or "-", r["steps"], r["mean_tokens_per_step"],
             f"{r['preemptions']} ({r['waste']:.0%})", f"{r['compile']['traces']}/{r['traces']}", f"{r['wall_s']:.1f}"]
            for r in runs]
    print("\nmeasured runs (after precompile; CPU, float32):")
    print(format_table(["workload", "N", "out tok/s", "total tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                        "decode tok/s", "steps", "tok/step", "preempt (waste)", "traces pre/meas", "wall s"], rows))
    rows = []
    for r in runs:
        t = r["time_s"]
        roof = r["decode_roofline"]
        rows.append([r["workload"], r["concurrency"], f"{t['prefill_steps']:.2f}", f"{t['decode_steps']:.2f}",
                     _split_ms(r["per_step"]["decode"]), _split_ms(r["per_step"]["prefill"]),
                     f"{roof['roofline_ms_per_step']:.1f} ({100 * roof['fraction_of_jitted']:.0f}%)" if roof else "-",
                     r["prefill_tokens_per_s"] or "-", len(r["buckets"]), f"{r['compile']['wall_s']:.1f}",
                     f"{100 * r['cpu_share']:.0f}%", r["loadavg_1m_after"]])
    print("\nwhere the time went (measured run; step ms p50 = jitted step + host (scheduling, packing, transfers in, "
          "bookkeeping); roofline = the bytes a decode step must read over the measured copy bandwidth, and its "
          "share of the jitted step; CPU = this process's share of all cores, well under ~90% or a load above the "
          "core count means other processes competed and that row is slowed):")
    print(format_table(["workload", "N", "prefill steps s", "decode steps s", "decode step ms", "prefill step ms",
                        "decode roofline ms (%)", "prefill tok/s", "buckets", "compile s", "CPU", "load"], rows))
    sys.stdout.flush()


def _print_profiles(runs: list[dict]) -> None:
    """Each run's per-component table (`profile_run`), decode and prefill steps apart."""
    from qwen35_lib.bench import profile as prof

    for r in runs:
        p = r.get("profile")
        if not p:
            continue
        if "error" in p:
            print(f"\nprofile of {r['workload']} N={r['concurrency']}: {p['error']}")
            continue
        for kind in ("decode", "prefill"):
            if kind in p:
                prof.print_summary(f"{kind} steps of {r['workload']} N={r['concurrency']}, where the time goes "
                                   "(profiled replay) beside each component's floor", p[kind])
    sys.stdout.flush()


def _split_ms(split: dict | None) -> str:
    """"wall = jitted + host" (p50 ms) of a `step_split`."""
    if not split:
        return "-"
    return f"{split['wall_ms']['p50']:,.1f} = {split['jitted_ms']['p50']:,.1f} + {split['host_ms']['p50']:,.1f}"


def _print_comparison(c: dict) -> None:
    t = c["output_tokens_per_s"]
    g = c["greedy_match"]
    print(f"\nvs transformers: {c['requests']} requests of {c['workload']} (prompts {min(c['prompt_lengths'])}-"
          f"{max(c['prompt_lengths'])}, outputs {min(c['output_lengths'])}-{max(c['output_lengths'])} tokens), "
          f"float32 both, same weights; median of {len(c['timings']['ours']['times_s'])}, interleaved; threads: "
          f"ours {c['ours']['threads']} (XLA:CPU), transformers {c['transformers']['threads']} (torch)")
    print(format_table(["", "seconds", "output tok/s"],
                       [["ours (engine, greedy)", c["timings"]["ours"]["median_s"], t["ours"]],
                        ["transformers generate (all rows to the longest)", c["timings"]["transformers"]["median_s"],
                         t["transformers"]],
                        ["transformers, requested tokens only", c["timings"]["transformers"]["median_s"],
                         t["transformers_useful"]]]))
    load = c["load"]
    print(f"ours / transformers: {ratio_text(c['speedup'], load)} output tokens/s (target >= {c['target']:g}x); "
          f"{ratio_text(c['speedup_useful'], load)} counting only the requested tokens")
    print(f"load: {load['loadavg_1m_before']} before, {load['loadavg_1m_after']} after on {load['cores']} cores; "
          f"this process {100 * (load['cpu_share'] or 0):.0f}% of the cores, other processes "
          f"{'-' if load['others_cores'] is None else round(load['others_cores'], 2)} cores")
    print(f"greedy tokens: {g['requests_identical']}/{c['requests']} requests identical ({g['first_32_identical']}/"
          f"{c['requests']} in their first 32); tokens before the first "
          f"difference: {g['tokens_before_first_difference']} (float32 both; a difference is a near-tie that "
          "rounding resolved the other way)")
    sys.stdout.flush()


def plot_results(doc: dict):
    """Throughput (output and total tokens/s) and latency (TTFT, TPOT p50 solid / p99 dashed) vs concurrency."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), layout="constrained")
    axes = fig.subplots(2, 2)
    panels = [(axes[0, 0], "output_tokens_per_s", "output tokens/s"),
              (axes[0, 1], "total_tokens_per_s", "total (input + output) tokens/s"),
              (axes[1, 0], "ttft_ms", "TTFT (ms)"), (axes[1, 1], "tpot_ms", "TPOT (ms)")]
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2"]
    for i, name in enumerate(doc["workloads"]):
        rs = sorted((r for r in doc["runs"] if r["workload"] == name), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        w = doc["workloads"][name]
        label = f"{name} ({w['input_len']}/{w['output_len']})"
        for ax, key, _ in panels:
            if key.endswith("_ms"):
                ax.plot(xs, [r[key]["p50"] for r in rs], "o-", color=colors[i % 5], label=f"{label} p50")
                ax.plot(xs, [r[key]["p99"] for r in rs], "o--", color=colors[i % 5], alpha=0.6, label=f"{label} p99")
            else:
                ax.plot(xs, [r[key] for r in rs], "o-", color=colors[i % 5], label=label)
    for ax, key, title in panels:
        ax.set_xscale("log", base=2)
        ax.set_xticks(doc["concurrency"], [str(c) for c in doc["concurrency"]])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if key.endswith("_ms"):
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=7, ncol=2)
    env = doc["environment"]
    title = (f"{doc['model']} engine, {doc['dtype']}, measured on CPU ({env.get('cores')} cores, {env.get('cpu')}); "
             f"lengths x{doc['scale']}, closed loop")
    vs = doc.get("vs_transformers")
    if vs:
        title += f"\nvs transformers generate at {vs['requests']} requests: {vs['speedup']:.2f}x output tokens/s"
    fig.suptitle(title, fontsize=10)
    return fig
