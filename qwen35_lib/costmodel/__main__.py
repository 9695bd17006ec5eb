"""`python -m qwen35_lib.costmodel predict --model NAME --hardware NAME --stage NAME --isl N --osl N --concurrency N
[--layout NAME --routing NAME --fuse-allgather --hierarchical-rs --kernels xla|pallas] [--max-batched-tokens N]
[--max-seqs N] [--kv-dtype D] [--mechanisms nominal|off] [--explain] [--no-band] [--json]` and
`python -m qwen35_lib.costmodel ladder [--json]`,
`python -m qwen35_lib.costmodel layouts --isl N --osl N [--concurrencies 1,2,...] [--kernels K] [--engine E] [--setup S]
[--json]` and
`python -m qwen35_lib.costmodel validate --moe | --published | --layouts | --ttft | --compiled [--json]`.

`predict --layout auto` prices every layout of `choice.CANDIDATES` that fits (tp8_kvrep, tp8_ep8, dp4_tp2_ep8,
dp8_ep8 with the given routing, flags and kernels) and serves the one with the most total tokens/s; its JSON names the
pick, the runner-up and the margin (`layout_choice`). `layouts` prints that ranking over concurrency (c1 ... c512):
each layout's total tokens/s and median TPOT, the best, the next and the margin. `--no-async-scheduling` predicts a
server without vLLM's --async-scheduling (the whole host turnaround on every step). `--setup library|tpu-inference`
sets each candidate's server as this library's recipe does or as tpu-inference's Qwen3.5 sweep did (its server.sh at
the layout's DP size: the published SHARDING_TABLE's settings); by default the `--engine`'s.

`predict` prints whole-slice output and total (input + output) tokens/s, per chip, the uncertainty band (the
one-at-a-time extremes of the labelled assumptions of data/costmodel_assumptions.json and their joint corners), the
mean step-time breakdown by component, and the roofline bound; `--explain` adds the breakdown per mechanism, each
with its assumption and source; a model that does not fit is reported so (exit status 0, `fits: false`).
`validate --ttft` prints the median TTFT beside the published rows that give one (tpu-recipes' runs, each under its
own setup); `validate --moe` prints the MoE layer sub-model beside the measured device times of production's layer
(the 8 cells of data/moe_layer_measured.json: which set the one derived constant, which judge it; then the same file's
second shape, Qwen3-30B-A3B, priced as its arm ran, which judges it too); `validate --published`
prints the acceptance figures against tpu-inference #3050 under each point's own setup (about 30 s); `validate
--compiled` sets the model's FLOPs and HBM bytes beside the stored TPU7x-8 decode compiles (`costmodel.compiled`).
Errors in the arguments print one `error: ...` line and exit with status 2 (`--debug`: the traceback).
"""

from __future__ import annotations

import argparse
import json
import sys

from qwen35_lib import cli_errors
from qwen35_lib.config import PRESETS
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.choice import CONCURRENCIES, ENGINES, SETUPS
from qwen35_lib.costmodel.predict import KV_DTYPES, predict, serving_model
from qwen35_lib.costmodel.stage_ladder import ladder
from qwen35_lib.plan import FAMILIES, ROUTINGS
from qwen35_lib.plan import cli as plan_cli


def _model(args: argparse.Namespace):
    changes = {}
    if args.expert_dtype:
        changes["expert_dtype"] = None if args.expert_dtype == "none" else args.expert_dtype
    return serving_model(args.model, **changes)


def _format(r: dict) -> str:
    head = (f"{r['model']} on {r['hardware']}, stage {r['stage']} ({r['layout']}, routing {r['routing']}, kernels "
            f"{r['kernels']}); ISL {r['isl']} / OSL {r['osl']} at {r['concurrency']} concurrent requests")
    if not r["fits"]:
        return f"{head}\ndoes not fit: {r['reason']}"
    lines = [head,
             f"  output tokens/s  {r['output_tokens_per_s']:12,.0f}  "
             f"({r['output_tokens_per_s_per_chip']:,.0f} per chip)",
             f"  total tokens/s   {r['total_tokens_per_s']:12,.0f}  ({r['total_tokens_per_s_per_chip']:,.0f} per chip)",
             f"  mean step        {r['mean_step_s'] * 1e3:12.2f} ms over {r['steps']:,} steps",
             f"  median TTFT      {r['median_ttft_s'] * 1e3:12.1f} ms",
             f"  median TPOT      {r['median_tpot_s'] * 1e3:12.2f} ms"]
    if "band" in r:
        b = r["band"]
        lo, hi = b["total_tokens_per_s"]
        lines.append(f"  band             {lo:12,.0f} - {hi:,.0f} total "
                     f"tokens/s (x{b['high_over_low']:.2f}); TPOT {b['median_tpot_s'][0] * 1e3:.1f} - "
                     f"{b['median_tpot_s'][1] * 1e3:.1f} ms  "
                     "(the labelled assumptions at their ends: one at a time, and all at once)")
    if "speculation" in r:  # --speculative-tokens
        sp = r["speculation"]
        src = (f"assumption {sp['assumption']}, range {sp['acceptance_low']:.2f} - {sp['acceptance_high']:.2f}: "
               f"{sp['assumption_source']}" if "assumption" in sp else "given")
        gain = sp["output_gain"]
        band = sp.get("output_gain_band")
        lines.append(f"  speculation      {sp['speculative_tokens']} MTP drafts a step at acceptance length "
                     f"{sp['acceptance_length']:.2f} ({src})")
        lines.append(f"  without it       {sp['without']['output_tokens_per_s']:12,.0f} output tokens/s; gain "
                     + (f"x{gain:.2f}" if gain else "-") + (f" (x{band[0]:.2f} - x{band[1]:.2f} over the acceptance "
                                                             "range)" if band and None not in band else ""))
    if "roofline_total_tokens_per_s" in r:
        lines.append(f"  roofline bound   {r['roofline_total_tokens_per_s']:12,.0f} total tokens/s "
                     f"({r['fraction_of_roofline']:.0%} of it reached)")
    lines.append("  breakdown of the mean step:")
    for k, v in sorted(r["breakdown_s"].items(), key=lambda kv: -kv[1]):
        if v > 0:
            lines.append(f"    {k:<16} {v * 1e3:9.3f} ms  {r['breakdown_fraction'][k]:6.1%}")
    if "explain" in r:
        e = r["explain"]
        lines.append("  per component, the assumptions it rests on:")
        for k, c in e["components"].items():
            lines.append(f"    {k:<16} {c['seconds'] * 1e3:9.3f} ms  {', '.join(c['assumptions'])}")
        lines.append("  per mechanism (switched off alone: the mean step's change, total tokens/s ratio):")
        for k, m in e["mechanisms"].items():
            if m["applied"]:
                lines.append(f"    {k:<28} {m['value']!s:>8}  {m['mean_step_s_delta'] * 1e3:+8.2f} ms  "
                             f"x{m['total_tokens_per_s_ratio']:.3f}  {m['assumption']['source']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = cli_errors.ArgumentParser(prog="python -m qwen35_lib.costmodel", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("predict", help="throughput of one stage for one workload")
    lad = sub.add_parser("ladder", help="every stage, prefill-heavy (8k/1k) and decode-heavy (1k/8k)")
    for q in (pr, lad):
        q.add_argument("--model", default="qwen3.5-397b-a17b", help=f"a preset ({', '.join(PRESETS)})")
        q.add_argument("--hardware", default="tpu7x-8", help="tpu7x-8, v6e-8, v5p-8, v5e-8, h200, h200-8, cpu")
        q.add_argument("--concurrency", type=int, default=512, help="requests in flight (default: %(default)s)")
        q.add_argument("--expert-dtype", choices=["float8_e4m3fn", "none"],
                       help="routed experts (default: float8_e4m3fn, the serving configuration)")
        q.add_argument("--kv-dtype", default="float8_e4m3fn", choices=KV_DTYPES,
                       help="KV cache dtype (default: %(default)s)")
        q.add_argument("--max-batched-tokens", type=int,
                       help="token budget per step per DP rank (default: the recipe's, 8 x max(ISL / 8, 1024) a slice)")
        q.add_argument("--max-seqs", type=int,
                       help="running sequences per DP rank (default: the recipe's 64 a rank at DP 8, 512 a slice)")
        q.add_argument("--num-prompts", type=int, help="requests in the benchmark (default: 10 x concurrency)")
        q.add_argument("--range-ratio", type=float, default=0.8,
                       help="each length uniform in [r L, L] (default: %(default)s, InferenceX's)")
        q.add_argument("--json", action="store_true", help="print one JSON document")
    plan_cli.add_arguments(pr, layout=None, stage="kernels", kernels=True, devices=False, auto=True)
    pr.add_argument("--no-async-scheduling", action="store_true",
                    help="a server without vLLM's --async-scheduling: the host turnaround on every step")
    pr.add_argument("--engine", choices=ENGINES, default="this",
                    help="--layout auto: price the candidates as this library's engine runs them (this, the default, "
                         "as --layout does) or as tpu-inference's does (its recipe's layouts)")
    pr.add_argument("--setup", choices=SETUPS,
                    help="--layout auto: each candidate's server settings: library (this library's recipe) or "
                         "tpu-inference (its Qwen3.5 sweep's server.sh at its layout's DP size: the settings the "
                         "published SHARDING_TABLE ran and `recipe` emits); default: the --engine's")
    pr.add_argument("--mechanisms", default="nominal", choices=("nominal", "off"),
                    help="the labelled serving mechanisms at their nominal values, or the model without them")
    pr.add_argument("--no-dp-batch-prefill", action="store_true",
                    help="tpu-inference's DP_SCHED_BATCH_PREFILL=false (new requests routed one by one)")
    pr.add_argument("--explain", action="store_true", help="the mean step per component and per mechanism")
    pr.add_argument("--no-band", action="store_true", help="skip the uncertainty band")
    pr.add_argument("--speculative-tokens", type=int, default=0,
                    help="MTP drafts a decoding sequence verifies each step (default: %(default)s, off)")
    pr.add_argument("--acceptance-length", type=float,
                    help="tokens a decoding sequence emits per step with drafts (default: the labelled assumption "
                         "mtp_acceptance_length of data/costmodel_assumptions.json)")
    pr.add_argument("--isl", type=int, default=8192, help="input tokens per request")
    pr.add_argument("--osl", type=int, default=1024, help="output tokens per request")
    lays = sub.add_parser("layouts", help="every layout priced over concurrency: the best, the next, the margin")
    lays.add_argument("--model", default="qwen3.5-397b-a17b", help=f"a preset ({', '.join(PRESETS)})")
    lays.add_argument("--hardware", default="tpu7x-8", help="tpu7x-8, v6e-8, v5p-8, v5e-8, h200, h200-8, cpu")
    lays.add_argument("--isl", type=int, default=8192, help="input tokens per request")
    lays.add_argument("--osl", type=int, default=1024, help="output tokens per request")
    lays.add_argument("--concurrencies", default=",".join(map(str, CONCURRENCIES)),
                      help="comma-separated concurrencies (default: %(default)s)")
    lays.add_argument("--expert-dtype", choices=["float8_e4m3fn", "none"],
                      help="routed experts (default: float8_e4m3fn, the serving configuration)")
    lays.add_argument("--kv-dtype", default="float8_e4m3fn", choices=KV_DTYPES,
                      help="KV cache dtype (default: %(default)s)")
    lays.add_argument("--routing", choices=ROUTINGS, default="replicate", help="the EP layouts' routing")
    lays.add_argument("--fuse-allgather", action="store_true", help="the data-parallel EP layouts: packed ids/weights")
    lays.add_argument("--hierarchical-rs", action="store_true", help="the data-parallel EP layouts: hierarchical RS")
    lays.add_argument("--kernels", choices=FAMILIES, default="xla", help="kernel family (default: %(default)s)")
    lays.add_argument("--no-async-scheduling", action="store_true", help="a server without --async-scheduling")
    lays.add_argument("--engine", choices=ENGINES, default="this",
                      help="price the layouts as this library's engine runs them or as tpu-inference's does")
    lays.add_argument("--setup", choices=SETUPS,
                      help="each layout's server settings: library (this library's recipe) or tpu-inference (its "
                           "Qwen3.5 sweep's server.sh at the layout's DP size, as the published SHARDING_TABLE ran); "
                           "default: the --engine's")
    lays.add_argument("--json", action="store_true", help="print one JSON document")
    val = sub.add_parser("validate", help="the model against measurements (MoE layer cells, published serving)")
    what = val.add_mutually_exclusive_group(required=True)
    what.add_argument("--moe", action="store_true", help="the MoE layer sub-model vs production's measured layer")
    what.add_argument("--published", action="store_true", help="tpu-inference #3050 (8k/1k, c64/128/256)")
    what.add_argument("--layouts", action="store_true",
                      help="the published low-concurrency layouts (tpu-inference #3050's DP4TP2_EP row)")
    what.add_argument("--ttft", action="store_true",
                      help="median TTFT vs the published rows that give one (tpu-recipes' DP8_EP runs, c128)")
    what.add_argument("--compiled", action="store_true",
                      help="FLOPs and HBM bytes vs the TPU7x-8 decode compiles (data/aot/tpu7x-8.json, aot/hlo/)")
    val.add_argument("--json", action="store_true", help="print one JSON document")
    cli_errors.add_debug_flag(p)
    return p


def _validate(args: argparse.Namespace) -> int:
    from qwen35_lib.costmodel import validate

    if args.compiled:
        from qwen35_lib import data
        from qwen35_lib.costmodel import compiled

        rows = compiled.compare(data.read_json("aot/tpu7x-8.json"))
        print(json.dumps(rows, indent=2) if args.json else compiled.table(rows))
        return 0
    if args.ttft:
        rows = validate.ttft_points()
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"median TTFT, median TPOT and total tokens/s, predicted / published (stage {validate.MEASURED_STAGE}, "
              "each row under its own setup)")
        for r in rows:
            pub, pred = r["published"], r["predicted"]
            mode = "on" if r["async_scheduling"] else "off"
            print(f"  {r['isl']}/{r['osl']} c{r['concurrency']} (async scheduling {mode}): TTFT "
                  f"{pred['median_ttft_ms']:,.0f} / {pub['median_ttft_ms']:,.0f} ms = "
                  f"x{r['median_ttft_ms_ratio']:.2f}  TPOT x{r['median_tpot_ms_ratio']:.2f}  total "
                  f"x{r['total_tokens_per_s_ratio']:.2f}  (published mean / p99 TTFT "
                  f"{pub['mean_ttft_ms']:,.0f} / {pub['p99_ttft_ms']:,.0f} ms, median / p99 ITL "
                  f"{pub['median_itl_ms']} / {pub['p99_itl_ms']} ms; model "
                  f"{pred['median_itl_ms']:.1f} / {pred['p99_itl_ms']:.1f} ms)")
        return 0
    if args.layouts:
        rows = validate.layout_points()
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        for r in rows:
            tpot = f"  median TPOT x{r['tpot_ratio']:.2f}" if "tpot_ratio" in r else ""
            tpot += (f"  median TTFT x{r['ttft_ratio']:.2f}" if "ttft_ratio" in r else
                     f"  median TTFT {r['predicted_median_ttft_ms']:,.0f} ms predicted")
            print(f"{r['setup']} ({r['layout']}), {r['isl']}/{r['osl']} c{r['concurrency']}: total tokens/s "
                  f"{r['predicted_total_tokens_per_s']:,.0f} predicted / {r['measured_total_tokens_per_s']:,.0f} "
                  f"published = x{r['ratio']:.2f}{tpot}")
        return 0
    if args.moe:
        rows, derived = validate.moe_layer_comparison(), validate.moe_row_overhead()
        second, rand = validate.moe_second_shape_comparison(), validate.moe_random_routing_comparison()
        if args.json:
            print(json.dumps(dict(cells=rows, moe_row_overhead=derived, random_routing=rand, second_shape=second),
                             indent=2))
            return 0

        def table(cells: list[dict], roles: bool = False) -> None:
            print(f"{'N':>6} {'measured us':>12} {'model us':>10} {'model/meas':>10}  {'kernels us':>10} "
                  f"{'model':>7} {'outside x':>9}" + ("  role" if roles else ""))
            for r in cells:
                flag = "" if r["within_25pct"] else "  OUTSIDE 25%"
                print(f"{r['tokens']:>6} {r['measured_us']:>12.1f} {r['model_us']:>10.1f} {r['ratio']:>10.2f}  "
                      f"{r['kernel_us']:>10.1f} {r['model_kernel_us']:>7.1f} {r['outside_ratio']:>9.2f}"
                      + (f"  {r['role']}" if roles else "") + flag)
            print(f"{sum(r['within_25pct'] for r in cells)}/{len(cells)} cells within 25%")

        print("MoE layer, Qwen3.5-397B-A17B-FP8 on TPU7x-8 (EP8), device time per layer call: model vs measured "
              "(production's layer, recorded routing; data/moe_layer_measured.json); beside it the grouped-matmul "
              "kernels (measured, and the model's routed_experts) and the rest of the layer (outside x: model / "
              "measured)")
        table(rows, roles=True)
        f = derived["fixed"]
        print(f"moe_layer_fixed_s = {f['value'] * 1e6:.1f} us a call ({f['low'] * 1e6:.1f} - {f['high'] * 1e6:.1f}) "
              f"and moe_row_overhead_s = {derived['value'] * 1e9:.2f} ns a routed row ({derived['low'] * 1e9:.2f} - "
              f"{derived['high'] * 1e9:.2f}; ranges: the fits leaving one cell out), set from the time outside the "
              f"kernels of N in {derived['cells']}")
        print("the same shape under random routing (the routing the model's touched-expert count assumes), nothing "
              "set from it:")
        table(rand)
        print("second shape, Qwen3-30B-A3B (128 experts top-8, hidden 2048, FFN 768; upstream defaults: no "
              "all-gathers, ragged permutes at every N, an all-reduce combine; random routing), nothing set from it:")
        table(second)
        return 0
    acc = validate.acceptance()
    if args.json:
        print(json.dumps(acc, indent=2))
        return 0
    print(f"tpu-inference #3050 (8k/1k, each point under its own setup), stage {acc['stage']}: predicted / published")
    for p in acc["points"]:
        ttft = (f"x{p['ttft_ratio']:.2f}" if p["ttft_ratio"] is not None else
                f"{p['predicted_median_ttft_ms']:,.0f} ms predicted (no published median TTFT)")
        print(f"  c{p['concurrency']:<4} total tokens/s x{p['ratio']:.2f}  median TPOT x{p['tpot_ratio']:.2f}  "
              f"inside the band: {p['inside_band']} / {p['tpot_inside_band']}  median TTFT {ttft}")
    print(f"  trend |ratio(c_max) / ratio(c_min) - 1| = {acc['trend']:.3f} (<= 0.15: {acc['trend_ok']}); "
          f"all within 25%: {acc['all_within_25pct']}")
    return 0


def _layouts(args: argparse.Namespace) -> int:
    from qwen35_lib.costmodel import choice

    try:
        concurrencies = tuple(int(c) for c in args.concurrencies.split(","))
    except ValueError:
        raise ValueError(f"--concurrencies takes integers separated by commas, got {args.concurrencies!r}") from None
    mech = Mechanisms.nominal(async_scheduling=False) if args.no_async_scheduling else "nominal"
    t = choice.table(_model(args), args.hardware, args.isl, args.osl, concurrencies, routing=args.routing,
                     fuse_allgather=args.fuse_allgather, hierarchical_rs=args.hierarchical_rs, kernels=args.kernels,
                     kv_dtype=args.kv_dtype, mechanisms=mech, engine=args.engine, setup=args.setup)
    print(json.dumps(t, indent=2) if args.json else choice.format_table(t))
    return 0


def _format_choice(c: dict) -> str:
    lines = [f"  layout auto: {c['picked']} served (the most {c['by'].replace('_', ' ')} of those that fit, priced as "
             f"{c['engine']} engine, {c.get('setup', 'library')} setup)"
             + (f"; runner-up {c['runner_up']}, margin {c['margin']:+.1%}" if c["runner_up"] else "")]
    for r in c["candidates"]:
        if r["fits"]:
            lines.append(f"    {r['layout']:<12} {r['total_tokens_per_s']:12,.0f} total tokens/s  TPOT "
                         f"{r['median_tpot_s'] * 1e3:7.2f} ms  TTFT {r['median_ttft_s'] * 1e3:9.1f} ms")
        else:
            lines.append(f"    {r['layout']:<12} does not fit: {r['reason']}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    if args.command == "validate":
        return _validate(args)
    if args.command == "layouts":
        return _layouts(args)
    common = dict(concurrency=args.concurrency, max_batched_tokens=args.max_batched_tokens,
                  max_seqs=args.max_seqs, kv_dtype=args.kv_dtype, num_prompts=args.num_prompts,
                  range_ratio=args.range_ratio)
    if args.command == "predict":
        mech = args.mechanisms
        setup = dict(dp_batch_prefill=False) if args.no_dp_batch_prefill else {}
        if args.no_async_scheduling:
            setup["async_scheduling"] = False
        if setup and mech == "nominal":
            mech = Mechanisms.nominal(**setup)
        elif setup:
            raise ValueError("--no-dp-batch-prefill and --no-async-scheduling set mechanisms of the nominal model; "
                             "drop them with --mechanisms off")
        options = dict(mechanisms=mech, band=not args.no_band and args.mechanisms == "nominal", explain=args.explain)
        if args.speculative_tokens or args.acceptance_length is not None:
            if args.layout == "auto":
                raise ValueError("--speculative-tokens prices one stage: name it with --stage (not --layout auto)")
            options.update(speculative_tokens=args.speculative_tokens, acceptance_length=args.acceptance_length)
        if args.layout == "auto":
            from qwen35_lib.costmodel import choice

            r = choice.choose(_model(args), args.hardware, args.isl, args.osl, routing=args.routing,
                              fuse_allgather=args.fuse_allgather, hierarchical_rs=args.hierarchical_rs,
                              kernels=args.kernels, engine=args.engine, setup=args.setup, **common, **options)
        else:
            r = predict(_model(args), args.hardware, plan_cli.from_args(args), args.isl, args.osl, **common,
                        **options)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(_format(r) + ("\n" + _format_choice(r["layout_choice"]) if "layout_choice" in r else ""))
        return 0
    rows = ladder(_model(args), args.hardware, **common)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        if not r["fits"]:
            tail = "does not fit"
        else:
            tail = f"{r['total_tokens_per_s']:10,.0f} total tok/s"
            tail += f"  x{r['vs_baseline']:.2f}"
            tail += f"  (x{r['vs_google_baseline']:.2f} vs google_baseline)" if "vs_google_baseline" in r else ""
        print(f"{r['workload']:>6} {r['stage']:<10} {tail}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli_errors.guard(lambda: _run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
