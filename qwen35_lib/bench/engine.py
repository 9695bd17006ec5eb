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
import os
import pathlib
import sys

from qwen35_lib.bench import workloads as wl
from qwen35_lib.bench.closed_loop import ablate_experts, engine_config, knobs, measure_run
from qwen35_lib.bench.timing import (
    environment,
    format_table,
    native_isa_text,
    ratio_text,
    warn_if_busy,
)
from qwen35_lib.bench.vs_transformers import compare_with_transformers, hf_twin, reference_available
from qwen35_lib.config import get_config
from qwen35_lib.plan import SINGLE

DESCRIPTION = ("serving throughput, TTFT, TPOT of the engine per workload and concurrency (closed loop); "
               "decode vs transformers' generate")
DEFAULTS = dict(model="qwen3.5-mini", concurrency="1,8,64", workloads="8k/1k,1k/8k,1k/1k", scale=None,
                vs_requests=8)
QUICK = dict(model="qwen3.5-tiny", concurrency="1,2", workloads="1k/1k", scale="1/64", vs_requests=2)
DECODE_TARGET = 4.0  # decode tokens/s at the largest concurrency over that at 1
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
        vs = reference_available()
    elif vs and not reference_available():
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
          f"{config.dtype}, moe_matmul={plan.kernel('moe_matmul')}, native kernels {native_isa_text()}; "
          f"lengths x{scale}: "
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
        "moe_kernel": plan.kernel("moe_matmul"),
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
