"""The serving engine under a closed loop, as `bench engine` measures it: every request submitted at once, the engine
stepped until all are done (`run_requests`), each step's wall, jitted and host time logged (`StepLog`); the run's
throughput, latency percentiles and where the time went (`metrics`); compilation kept out (`measure_run`: every
bucket precompiled first, the run measured again if it still compiled); the run replayed under `jax.profiler` per
component (`profile_run`); the routed experts by ablation (`ablate_experts`: the grouped matmul replaced by zeros)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np

from qwen35_lib.bench.timing import BusyMonitor, progress
from qwen35_lib.config import Config
from qwen35_lib.plan import SINGLE, ServingPlan


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
    from qwen35_lib.engine.step import engine_step
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

