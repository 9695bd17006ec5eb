"""`python -m qwen35_lib.bench layouts`: one engine step under each stage's layout and routing, side by side.

The stages of the playbook's ladder (`qwen35_lib.plan.STAGES`, XLA kernels): `baseline` = tp8_kvrep,
`dp_ep` = dp8_ep8 + all_to_all, `replicate` = dp8_ep8 + replicate, `fused_ag` = + fuse_allgather, `hier_rs` =
+ hierarchical_rs, on the 8-device `('chip', 'core')` mesh (8 simulated CPU devices here).

1. One set of random weights; per stage an `Engine` (weights sharded by its layout, caches per rank).
2. Two global batches, the same for every stage, split over the stage's data-parallel ranks (tp8_kvrep has one
   rank holding everything; dp8_ep8 has 8): decode-sized (`--seqs` sequences decoding one token each at
   `--context`) and prefill-sized (`--prefill-seqs` prompts of `--prefill-len` tokens), packed as the engine
   packs them, placed on the devices once.
3. The jitted step (`engine.step.engine_step`) of every (stage, batch) is compiled, then all are timed
   interleaved (`timing.measure`); medians and speedups over `baseline` measured in the same run.
4. The greedy tokens of each batch's first (warm-up) step are compared across stages (same weights, same fresh
   cache, so they agree unless a near-tie rounds differently under another reduction order).

Caveat, printed with the table: collectives between simulated CPU devices are memory copies inside one process
(and the 8 "devices" share this machine's cores), so these ratios show each layout's compute and data movement
at CPU size, not TPU7x interconnect costs; for those see the cost model and the TPU7x compiles.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from qwen35_lib.bench.timing import environment, format_table, measure, warn_if_busy
from qwen35_lib.plan import STAGES, get_stage

DESCRIPTION = ("one engine step (decode- and prefill-sized) per stage's layout and routing (tp8_kvrep, dp8_ep8 + "
               "all_to_all / replicate / fused all-gather / hierarchical reduce-scatter) on 8 CPU devices")
STAGE_NAMES = tuple(n for n, s in STAGES.items() if s.kernels == "xla")  # the ladder's XLA-kernel stages
DEFAULTS = dict(model="qwen3.5-mini", seqs=64, context=128, prefill_seqs=8, prefill_len=128)
QUICK = dict(model="qwen3.5-tiny", seqs=16, context=32, prefill_seqs=8, prefill_len=64)
CAVEAT = ("collectives between simulated CPU devices are memory copies inside one process, and the 8 devices share "
          "this machine's cores: the ratios show each layout's compute and data movement at CPU size, not TPU7x "
          "interconnect costs (see the cost model and the TPU7x compiles)")
PAGE_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"a preset (default: {DEFAULTS['model']}; --quick: {QUICK['model']})")
    p.add_argument("--dtype", default="float32", help="weights and activations (default: %(default)s)")
    p.add_argument("--stages", default=",".join(STAGE_NAMES),
                   help="comma-separated, baseline first for the ratios (default: %(default)s)")
    p.add_argument("--seqs", type=int, help=f"decode batch: sequences in all (default: {DEFAULTS['seqs']})")
    p.add_argument("--context", type=int, help=f"decode batch: context of each (default: {DEFAULTS['context']})")
    p.add_argument("--prefill-seqs", type=int, help=f"prefill batch: prompts (default: {DEFAULTS['prefill_seqs']})")
    p.add_argument("--prefill-len", type=int, help=f"prefill batch: tokens each (default: {DEFAULTS['prefill_len']})")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the tokens")
    p.add_argument("--quick", action="store_true", help="tiny model, small batches")


def options(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else DEFAULTS
    o = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    o["stages"] = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(o["stages"]) - set(STAGE_NAMES)
    if unknown or not o["stages"]:
        raise ValueError(f"--stages: unknown {sorted(unknown)}; choose from {', '.join(STAGE_NAMES)}")
    if min(o["seqs"], o["context"], o["prefill_seqs"], o["prefill_len"]) < 1:
        raise ValueError("--seqs, --context, --prefill-seqs and --prefill-len must be >= 1")
    return o


def _split(total: int, ranks: int, what: str) -> int:
    if total % ranks:
        raise ValueError(f"{what}={total} does not split evenly over {ranks} data-parallel ranks: use a multiple "
                         f"of {ranks}")
    return total // ranks


def step_inputs(engine, batch: str, opts: dict, rng: np.random.Generator) -> dict:
    """One step's (tokens, meta, sampling) of the global `batch` ("decode" or "prefill") split over the engine's
    ranks, packed like `Engine.step` packs them, placed on the mesh; with D, T and the per-rank counts."""
    import jax

    from qwen35_lib.engine.batch import SeqWork, pack, stack_ranks
    from qwen35_lib.parallel.shardings import batch_sharding

    R, C, ec = engine.ec.ranks, engine.chunk, engine.ec
    if batch == "decode":
        n, lens, starts = _split(opts["seqs"], R, "--seqs"), 1, opts["context"] - 1
    else:
        n, lens, starts = _split(opts["prefill_seqs"], R, "--prefill-seqs"), opts["prefill_len"], 0
    packs = []
    for _ in range(R):
        works, page = [], 1
        for s in range(n):
            pages = list(range(page, page + -(-(starts + lens) // ec.page_size)))
            page += len(pages)
            works.append(SeqWork(rng.integers(2, engine.config.vocab_size, lens).tolist(), starts, pages, s + 1))
        dec, pre = (works, []) if batch == "decode" else ([], works)
        D, T = engine.step_shape(len(dec), sum(-(-len(w.tokens) // C) * C for w in pre))
        packs.append(pack(dec, pre, D, T, ec.max_num_seqs, ec.pages_per_seq, C))
    tokens, meta = stack_ranks(packs)
    S = ec.max_num_seqs
    samp = dict(temperature=np.zeros((R, S), np.float32), top_k=np.zeros((R, S), np.int32),
                top_p=np.ones((R, S), np.float32), seed=np.zeros((R, S), np.uint32),
                position=np.zeros((R, S), np.int32))
    place = lambda x: jax.device_put(x, batch_sharding(engine.plan, engine.mesh, x.ndim))
    args = jax.tree.map(place, (tokens, meta, samp))
    return dict(args=args, D=D, T=T, seqs_per_rank=n, real_tokens=R * n * lens, valid=(R, n))


def make_engine(config, plan, weights, opts: dict, mesh):
    from qwen35_lib.engine import Engine, EngineConfig

    R = plan.dp_size(mesh)
    seqs = max(_split(opts["seqs"], R, "--seqs"), _split(opts["prefill_seqs"], R, "--prefill-seqs"))
    per_rank_prefill = _split(opts["prefill_seqs"], R, "--prefill-seqs") * opts["prefill_len"]
    longest = max(opts["context"], opts["prefill_len"])
    ec = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=max(per_rank_prefill, seqs), page_size=PAGE_SIZE,
                      max_model_len=-(-longest // PAGE_SIZE) * PAGE_SIZE)
    return Engine(config, weights, ec, mesh=mesh, plan=plan)


def run(args: argparse.Namespace) -> dict:
    import jax

    from qwen35_lib.cli_generate import layout_mesh
    from qwen35_lib.config import get_config
    from qwen35_lib.engine.step import engine_step
    from qwen35_lib.weights import init_weights

    opts = options(args)
    mesh = layout_mesh()  # 8 devices; on CPU made here when no backend runs yet
    load_before = warn_if_busy()
    base = get_config(opts["model"], dtype=args.dtype)
    plans = {name: get_stage(name) for name in opts["stages"]}
    weights = init_weights(base, args.seed)  # the same values under every layout
    rng = np.random.default_rng(args.seed)
    engines = {name: make_engine(base, plan, weights, opts, mesh) for name, plan in plans.items()}
    inputs = {}
    for batch in ("decode", "prefill"):
        state = rng.bit_generator.state  # the same tokens for every stage
        for name, eng in engines.items():
            rng.bit_generator.state = state
            inputs[name, batch] = step_inputs(eng, batch, opts, rng)

    def candidate(name: str, batch: str):
        eng, inp = engines[name], inputs[name, batch]

        def call():
            with jax.set_mesh(eng.mesh):
                out, eng.cache = engine_step(eng.config, eng.plan, eng.weights, eng.cache, *inp["args"])
            return out

        return call

    print(f"layouts benchmark: {base.name}, {base.dtype}, {len(mesh.devices.flat)} {jax.default_backend()} devices "
          f"{dict(mesh.shape)}; decode: {opts['seqs']} sequences x 1 token at context {opts['context']}; prefill: "
          f"{opts['prefill_seqs']} x {opts['prefill_len']} tokens")
    print(f"caveat: {CAVEAT}")
    sys.stdout.flush()
    timings, outputs = measure({f"{n}/{b}": candidate(n, b) for n, b in inputs}, repeats=args.repeats,
                               settle=args.settle, desc="layouts")
    doc = _document(opts, base, plans, engines, inputs, timings, outputs, mesh)
    doc["environment"] = environment(loadavg_1m_before=load_before)
    _print(doc)
    return doc


def _document(opts, base, plans, engines, inputs, timings, outputs, mesh) -> dict:
    first = opts["stages"][0]
    stages, agree = {}, {}
    for batch in ("decode", "prefill"):
        tokens = {}
        for name in plans:
            R, n = inputs[name, batch]["valid"]
            tokens[name] = np.asarray(outputs[f"{name}/{batch}"].addressable_data(0))[:R, :n].reshape(-1).tolist()
        agree[batch] = all(t == tokens[first] for t in tokens.values())
    for name, plan in plans.items():
        entry = dict(layout=plan.layout, routing=plan.routing, fuse_allgather=plan.fuse_allgather,
                     hierarchical_rs=plan.hierarchical_rs, ranks=engines[name].ec.ranks)
        for batch in ("decode", "prefill"):
            inp, t = inputs[name, batch], timings[f"{name}/{batch}"]
            entry[batch] = dict(D=inp["D"], T=inp["T"], seqs_per_rank=inp["seqs_per_rank"],
                                real_tokens=inp["real_tokens"], tokens_per_s=inp["real_tokens"] / t.median,
                                **t.to_json())
        entry["speedup_vs_baseline"] = {b: timings[f"{first}/{b}"].median / timings[f"{name}/{b}"].median
                                        for b in ("decode", "prefill")}
        stages[name] = entry
    return {
        "benchmark": "layouts",
        "model": base.name,
        "dtype": base.dtype,
        "devices": int(mesh.devices.size),
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "baseline": first,
        "batches": {"decode": {"seqs": opts["seqs"], "context": opts["context"]},
                    "prefill": {"seqs": opts["prefill_seqs"], "tokens_each": opts["prefill_len"]}},
        "stages": stages,
        "speedup": "baseline median / stage median, same run (> 1: faster than the baseline)",
        "greedy_tokens_agree": agree,
        "caveat": CAVEAT,
    }


def _print(doc: dict) -> None:
    rows = []
    for name, s in doc["stages"].items():
        flags = "+".join(f for f in ("fuse_allgather", "hierarchical_rs") if s[f]) or "-"
        rows.append([name, s["layout"], s["routing"] or "(TP MoE)", flags, s["ranks"],
                     f"{1e3 * s['decode']['median_s']:.2f}", f"{s['speedup_vs_baseline']['decode']:.2f}x",
                     f"{1e3 * s['prefill']['median_s']:.2f}", f"{s['speedup_vs_baseline']['prefill']:.2f}x",
                     f"{s['prefill']['tokens_per_s']:,.0f}"])
    print(f"\none engine step, median of {len(next(iter(doc['stages'].values()))['decode']['times_s'])} "
          f"(interleaved); speedup = {doc['baseline']} / stage, measured in this run:")
    print(format_table(["stage", "layout", "routing", "flags", "ranks", "decode ms", "vs base", "prefill ms",
                        "vs base", "prefill tok/s"], rows))
    a = doc["greedy_tokens_agree"]
    print(f"greedy tokens of the first step equal across stages: decode {a['decode']}, prefill {a['prefill']}")
    print(f"caveat: {doc['caveat']}")
    sys.stdout.flush()
