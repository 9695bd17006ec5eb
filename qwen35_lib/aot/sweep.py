"""The ahead-of-time sweep: every stage's engine steps compiled for TPU7x-8 at the serving shape, from this CPU.

    python -m qwen35_lib.aot sweep [--model NAME] [--stages S,...] [--groups N] [--json PATH]

The shape is fixed so that a small pool cannot buy a fit: 512 concurrent requests (64 sequences per rank under
DP8, all 512 in the one rank of a TP stage), pools for every request's whole context (9,216 tokens: 8k + 1k and
1k + 8k alike) in an FP8 KV cache of 256-token pages, FP8 experts and a bf16 GDN state. Two steps per workload:
`decode` (every sequence decoding) and `mixed` (all but one decoding, in the engine's decode bucket, plus 1,024
prefill tokens per rank: the token budget of tpu-inference's recipe). The two workloads have the same pools and
step shapes, so each stage compiles two programs and both workloads' entries read them.

Weights and caches are abstract (`aot.compile_step`: nothing is allocated). Each entry records XLA's
`memory_analysis()` (total = argument + output - alias + temp + code), its FLOPs and bytes, the compiled
collectives of the whole step and of one layer group, and the compile time. A step that does not fit is refused
by the TPU compiler (RESOURCE_EXHAUSTED); the entry keeps its message. The usable HBM is the compiler's own
figure, read from its refusal of a program that cannot fit (`usable_bytes`), never typed in.

It also finds each stage's largest pool: the most pages per sequence, at the same concurrency, for which the
decode step still fits (`largest_pool`: a guess from the headroom, checked by compiling it and one page more).

The sweep is resumable: `--json` is rewritten after every entry and entries already there (same model,
topology, groups and flags) are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import math
import os
import pathlib
import re
import sys
import time

STEP_NAMES = ("8k/1k decode", "8k/1k mixed", "1k/8k decode", "1k/8k mixed")


@dataclasses.dataclass(frozen=True)
class ServingShape:
    requests: int = 512  # concurrent requests over the whole slice
    context_len: int = 9216  # 8192 + 1024 and 1024 + 8192: a pool for every request's whole context
    page_size: int = 256
    kv_dtype: str = "float8_e4m3fn"
    prefill: int = 1024  # prefill tokens per rank in a mixed step (tpu-inference's max-num-batched-tokens)

    def tokens(self, step: str, ranks: int) -> tuple[int, int]:
        """(decode tokens, prefill tokens) per rank of `step` ("... decode" or "... mixed"): the decode region is
        the engine's bucket for its sequences (a power of two, `engine.Engine.decode_buckets`: 64 for the mixed
        step's 63 decodes, so a rank's 64 + 1,024 rows split into whole 8-row tiles over 8 devices; at 63 + 1,024
        XLA:TPU compiled each MoE reduce-scatter as an all-reduce plus permutes, issue 30)."""
        seqs = -(-self.requests // ranks)
        if step.endswith("decode"):
            return seqs, 0
        return 1 << max(seqs - 2, 0).bit_length(), self.prefill  # next power of two >= seqs - 1


SERVING = ServingShape()
# What a TPU compiler flag was seen to change in the compiled step (libtpu 0.0.42.1, jax 0.10.2; recorded in the
# sweep document's xla_flags.notes when the flag is set; tests/integration/test_tpu_overlap.py checks it).
FLAG_NOTES = {
    "xla_tpu_enable_sparse_core_collective_offload_reduce_scatter":
        "without the flag TPU7x already runs every reduce-scatter (and all-gather) of the step on the SparseCore, "
        "async (call-start/call-done, async_execution_thread=sparsecore), and the hierarchical RS's micro-batches "
        "overlap; 'false' makes each phase a synchronous TensorCore reduce-scatter in program order (core 0, "
        "chip 0, core 1, chip 1): no overlap",
}


def serving_config(model: str, groups: int | None = None, **overrides):
    """`model` as it is served on TPU7x: FP8 experts, bf16 GDN state (`overrides` replace fields); `groups` layer
    groups if given."""
    from qwen35_lib.config import get_config

    cfg = get_config(model, **{"expert_dtype": "float8_e4m3fn", "gdn_state_dtype": "bfloat16", **overrides})
    return cfg.replace(num_layers=groups * len(cfg.layer_pattern)) if groups else cfg


@functools.cache
def usable_bytes(topology: str | None = None) -> int:
    """Bytes one device of `topology` (default tpu7x:2x2x1) can hold, as the TPU compiler states it when it refuses
    a program too large for any device ("exceeds available HBM (94.75G)"; XLA's G is GiB, two decimals)."""
    import jax
    import jax.numpy as jnp

    from qwen35_lib import aot

    device = aot.topology_devices(topology or aot.TPU7X_8)[0]
    huge = jax.ShapeDtypeStruct((2**40 // 4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    try:
        jax.jit(lambda a: a.sum(), keep_unused=True).lower(huge).compile()
    except jax.errors.JaxRuntimeError as e:
        m = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(e))
        if m:
            return round(float(m[1]) * 2**30)
        raise RuntimeError(f"the TPU compiler refused a 1 TiB program without stating its HBM: {e}") from e
    raise RuntimeError("the TPU compiler accepted a 1 TiB program: cannot read the usable HBM from it")


def cache_shape(shape: ServingShape, plan, mesh, verify: int = 1):
    """The engine's `CacheShape` for `shape` under the bound `plan` on `mesh` (`aot.serving_pools`, what
    `compile_step` gives the step): each data-parallel rank's sequences' whole contexts in pages (and the null page),
    a slot each (and the null slot); the FP8 pool as the plan's attention stores it; `verify` > 1: with speculative
    verification's checkpoints."""
    from qwen35_lib import aot

    return aot.serving_pools(plan.bound(mesh, kv_dtype=shape.kv_dtype), shape.requests, shape.context_len,
                             shape.page_size, verify)


def resident(cfg, plan, shape: ServingShape, mesh, verify: int = 1) -> dict[str, int]:
    """Per-device bytes of the weights, KV cache and GDN state one device holds (the largest device's share) under
    the bound `plan` (`cfg` as placed: tp_kvrep's duplicated KV heads)."""
    import jax
    import jax.numpy as jnp

    from qwen35_lib.engine.cache import abstract_cache
    from qwen35_lib.parallel.shardings import weight_shardings
    from qwen35_lib.weights import abstract_weights

    def per_device(arrays) -> int:  # ShapeDtypeStructs with shardings -> the fullest device's bytes
        out: dict = {}
        for a in jax.tree.leaves(arrays):
            n = math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
            for d in a.sharding.device_set:
                out[d] = out.get(d, 0) + n
        return max(out.values(), default=0)

    cache = abstract_cache(cfg, cache_shape(shape, plan, mesh, verify), plan, mesh)
    kv = {k: v for k, v in cache.items() if k in ("kv", "kv_scale")}
    return {"weight_bytes": per_device(abstract_weights(cfg, weight_shardings(cfg, plan, mesh))),
            "kv_bytes": per_device(kv), "gdn_state_bytes": per_device({k: v for k, v in cache.items() if k not in kv})}


def compile_entry(cfg, stage: str, step: str, mesh, shape: ServingShape = SERVING,
                  compiler_options: dict | None = None, usable: int | None = None,
                  weight_layouts: str = "default", hlo_dir=None, speculative_tokens: int = 0) -> dict:
    """One sweep entry: `stage`'s engine step `step` compiled for `mesh` at `shape` (see the module doc);
    `hlo_dir`: also write the optimized HLO text there, gzipped (`hlo_path`); `speculative_tokens` k > 0: the
    verify step of k drafts a decode row (`aot.compile_step`), under `speculative_plan(stage)`."""
    import jax

    from qwen35_lib import aot
    from qwen35_lib.aot import hlo_checks
    from qwen35_lib.parallel import hlo
    from qwen35_lib.plan import any_stage

    plan = any_stage(stage)
    if speculative_tokens:
        plan = speculative_plan(plan, mesh, cfg)
    plan = plan.bind(mesh, cfg, kv_dtype=shape.kv_dtype)  # checked; kernels for the mesh's platform
    R, V = plan.dp, speculative_tokens + 1
    decode, prefill = shape.tokens(step, R)
    entry: dict = {"ranks": R, "decode_tokens_per_rank": decode, "prefill_tokens_per_rank": prefill,
                   **resident(plan.placed(), plan, shape, mesh, V)}  # tp_kvrep: duplicated KV heads
    if speculative_tokens:
        entry.update(speculative_tokens=speculative_tokens, kernels={s: plan.kernel(s) for s in SLOTS})
    start = time.perf_counter()
    try:
        compiled = aot.compile_step(cfg, plan, mesh, requests=shape.requests, context_len=shape.context_len,
                                    decode=decode, prefill=prefill, page_size=shape.page_size,
                                    kv_dtype=shape.kv_dtype, compiler_options=compiler_options,
                                    weight_layouts=weight_layouts, speculative_tokens=speculative_tokens)
    except jax.errors.JaxRuntimeError as e:
        entry.update(compile_s=time.perf_counter() - start, fits=False, error=str(e).splitlines()[0])
        return entry
    entry["compile_s"] = time.perf_counter() - start
    ma = compiled.memory_analysis()
    mem = dict(argument_bytes=ma.argument_size_in_bytes, output_bytes=ma.output_size_in_bytes,
               alias_bytes=ma.alias_size_in_bytes, temp_bytes=ma.temp_size_in_bytes,
               code_bytes=ma.generated_code_size_in_bytes)
    mem["total_bytes"] = (mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"] +
                          mem["code_bytes"])
    mem["peak_bytes"] = getattr(ma, "peak_memory_in_bytes", None)
    entry.update(mem)
    if usable is not None:
        entry["headroom_bytes"] = usable - mem["total_bytes"]
        entry["fits"] = entry["headroom_bytes"] >= 0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    entry["flops"], entry["bytes_accessed"] = cost.get("flops"), cost.get("bytes accessed")
    text = compiled.as_text()
    if hlo_dir is not None:
        path = hlo_path(hlo_dir, stage, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    try:
        entry["collectives"] = collectives(text, plan, cfg, shape.requests, decode * V, prefill)
    except ValueError as e:  # the verify step's acceptance branches (greedy / sampled) hold collectives
        if not speculative_tokens:
            raise
        entry["collectives"], entry["collectives_error"] = None, str(e)
    entry["bytes_by_block"] = hlo.op_bytes(text)  # the text's own account of the bytes (`costmodel.compiled`)
    body = hlo.layer_body(text)
    entry["collectives_per_group"] = hlo.count(text, body) if body else None
    if body:  # copies of a layer's cache pool in the layer loop (`hlo_checks.cache_pool_copies`): none in place
        pools = aot.cache_pools(plan.placed(), plan, mesh, cache_shape(shape, plan, mesh, V))
        copies = hlo_checks.cache_pool_copies(text, pools)
        entry["cache_pool_copies"], entry["cache_pools_copied"] = len(copies), sorted({n for n, _ in copies})
    if plan.routing == "replicate" and not plan.fuse_allgather and body:
        moe_layers = len(cfg.layer_pattern)  # every layer of a group has an MoE
        ags = entry["collectives_per_group"].get("all-gather", {}).get("count", 0)
        entry["allgathers_combined"] = ags < 3 * moe_layers  # the unfused stage issues 3 per MoE layer
    return entry


def speculative_plan(plan, mesh, cfg):
    """`plan` as the engine verifies drafts under it: each kernel slot the engine's verification cannot run
    (`engine.speculative.VERIFY_KERNELS`: the GDN's per-position checkpoints are kept by its XLA, Pallas and native
    forms, the attention's by XLA's) replaced by the slot's first there, the rest (layout, routing, collectives,
    MoE and dense kernels) kept."""
    from qwen35_lib.engine.speculative import VERIFY_KERNELS

    bound = plan.bind(mesh, cfg)
    return plan.replace(**{f"{slot}_kernel": ok[0] for slot, ok in VERIFY_KERNELS.items()
                           if bound.kernel(slot) not in ok})


SLOTS = ("attention", "gdn", "moe_matmul", "dense")


def hlo_path(hlo_dir, stage: str, step: str) -> pathlib.Path:
    """Where `compile_entry(hlo_dir=)` writes a step's HLO text: `<stage>-<workload>-<kind>.hlo.gz`."""
    return pathlib.Path(hlo_dir) / f"{stage}-{step.replace('/', '_').replace(' ', '-')}.hlo.gz"


def collectives(hlo_text: str, plan, config, requests: int, decode: int, prefill: int) -> dict[str, dict]:
    """{kind: {"count", "bytes", "model_count", "model_bytes"}} per device per step: what the compiled step runs
    (`hlo.step_counts`: loop bodies times their trip count) beside the cost model's closed form
    (`costmodel.traffic.collective_counts` of the bound `plan`), every kind either one has."""
    from qwen35_lib.costmodel import traffic
    from qwen35_lib.parallel import hlo

    got = hlo.step_counts(hlo_text)
    want = traffic.collective_counts(plan, config, traffic.StepShape.of_compile(config, plan.dp, requests, decode,
                                                                                  prefill), backend="tpu")
    out = {}
    for kind in sorted(set(got) | {k for k, (c, _) in want.items() if c}):
        seen = got.get(kind, {"count": 0, "bytes": 0})
        out[kind] = dict(count=seen["count"], bytes=seen["bytes"], model_count=want.get(kind, (0, 0))[0],
                         model_bytes=want.get(kind, (0, 0.0))[1])
    return out


def _versions() -> dict:
    import jax

    from qwen35_lib.versions import installed_version

    return {"jax": jax.__version__, "libtpu": installed_version("libtpu") or installed_version("libtpu-nightly")}


def sweep(model: str = "qwen3.5-397b-a17b", stages=None, groups: int | None = None, json_path=None,
          compiler_options: dict | None = None, shape: ServingShape = SERVING, progress: bool = True,
          overrides: dict | None = None, steps=STEP_NAMES, weight_layouts: str = "mxu", largest: bool = True,
          hlo_dir=None) -> dict:
    """The sweep document (see the module doc); `json_path` is rewritten after each entry and resumed from.
    `overrides`: config fields replaced after the serving ones (tests: a tiny model without FP8 experts);
    `weight_layouts`: `aot.compile_step`'s ("mxu": bf16 weights tiled and ordered as the step's dots read them,
    as a server places them once at load; "default": as `jax.device_put` leaves them, which costs relayouts of
    stacked weights every step, growing with depth; recorded in the document when not "default"); `largest`:
    also find each stage's largest pool (`largest_pool`, a few more decode compiles; cached as `largest_pool`);
    `hlo_dir`: keep each step's HLO text there (`hlo_path`)."""
    from tqdm.auto import tqdm

    from qwen35_lib import aot
    from qwen35_lib.plan import LADDER, any_stage

    stages = list(stages or LADDER)
    for s in stages:
        any_stage(s)  # an unknown name fails before any compile
    for st in steps:
        if st not in STEP_NAMES:
            raise ValueError(f"unknown step {st!r}; steps: {', '.join(STEP_NAMES)}")
    cfg = serving_config(model, groups, **(overrides or {}))
    usable = usable_bytes()
    head = {"model": model, "groups": cfg.num_groups, "overrides": dict(overrides or {}), "topology": aot.TPU7X_8,
            **_versions(),
            "xla_flags": {"LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
                          "compiler_options": dict(compiler_options or {}),
                          **({"notes": {k: FLAG_NOTES[k] for k in compiler_options if k in FLAG_NOTES}}
                             if set(compiler_options or {}) & set(FLAG_NOTES) else {})},
            **({"weight_layouts": weight_layouts} if weight_layouts != "default" else {}),
            "shape": dataclasses.asdict(shape), "usable_bytes": usable}
    doc = dict(head, stages={})
    path = pathlib.Path(json_path) if json_path else None
    if path is not None and path.exists():
        old = json.loads(path.read_text())
        if {k: old.get(k) for k in head} == head:
            doc["stages"] = old.get("stages", {})
    mesh = aot.chip_core_mesh()
    todo = [(s, st) for s in stages for st in steps if st not in doc["stages"].get(s, {}).get("steps", {})]
    bar = tqdm(todo, desc="aot sweep", unit="step", disable=not progress, file=sys.stderr)
    for stage, step in bar:
        bar.set_postfix_str(f"{stage} {step}")
        steps = doc["stages"].setdefault(stage, {"steps": {}})["steps"]
        twin = next((steps[o] for o in steps if o.split()[1] == step.split()[1]), None)  # same shapes, other workload
        t0 = time.perf_counter()
        steps[step] = dict(twin, same_program_as=next(o for o in steps if steps[o] is twin)) if twin else \
            compile_entry(cfg, stage, step, mesh, shape, compiler_options, usable, weight_layouts, hlo_dir)
        doc["stages"][stage]["wall_s"] = doc["stages"][stage].get("wall_s", 0) + time.perf_counter() - t0
        _save(path, doc)
    for stage in stages if largest else ():
        s = doc["stages"].get(stage, {})
        # a refused decode step (the baseline's) is searched downwards from its pool
        decode = next((e for k, e in s.get("steps", {}).items() if k.endswith("decode")), None)
        if decode is None or "largest_pool" in s:
            continue
        t0 = time.perf_counter()
        s["largest_pool"] = largest_pool(cfg, stage, mesh, shape, usable, decode, compiler_options, weight_layouts,
                                         hlo_dir=hlo_dir)
        s["wall_s"] = s.get("wall_s", 0) + time.perf_counter() - t0
        _save(path, doc)
    return doc


def _save(path, doc: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))


def largest_pool(cfg, stage: str, mesh, shape: ServingShape, usable: int, decode: dict,
                 compiler_options: dict | None = None, weight_layouts: str = "mxu", max_compiles: int = 6,
                 hlo_dir=None) -> dict:
    """The most pages per sequence (every sequence's pool, at `shape`'s concurrency) for which `stage`'s decode
    step still compiles within `usable` bytes a device.

    1. guess n from the decode entry at `shape`: its pages per sequence plus its headroom over the KV bytes one
       page per sequence adds (the pool is the only argument that grows with n);
    2. compile the decode step at n pages per sequence; a fit raises the lower bound, a refusal (or a total above
       `usable`) the upper one; the next n is where that compile's total meets `usable` at the same bytes a page
       (halfway between the bounds after a refusal), one page on if that is n, until the bounds are one page
       apart or `max_compiles` compiles are spent ("exact": false then).
    Returns {"pages_per_seq", "tokens_per_seq", "exact", "tried": {pages: total bytes or the refusal}, "decode":
    the entry of the largest pool that compiled (its `context_len` with it; its HLO text as step "pool decode" in
    `hlo_dir`)}."""
    from qwen35_lib.engine.cache import CacheShape

    page = shape.page_size
    now = -(-shape.context_len // page)  # pages a sequence's context takes now
    pool = CacheShape.for_requests(shape.requests, shape.context_len, ranks=decode["ranks"], page_size=page)
    seqs = pool.seqs_per_rank
    per_page = decode["kv_bytes"] / pool.num_pages  # bytes a device holds per pool page
    lo, hi = (now, None) if decode.get("fits") else (0, now)
    guess = now + int(decode.get("headroom_bytes", 0) // (per_page * seqs)) if decode.get("fits") else now // 2
    tried: dict = {}
    best = None
    n = guess
    while len(tried) < max_compiles and (hi is None or hi - lo > 1):
        e = compile_entry(cfg, stage, f"pool{n} decode", mesh, dataclasses.replace(shape, context_len=n * page),
                          compiler_options, usable, weight_layouts, hlo_dir)
        total = e.get("total_bytes")
        tried[str(n)] = total if total is not None else e.get("error")
        if e.get("fits"):
            if best is None or n > best[0]:
                best = (n, dict(e, context_len=n * page))
            lo = n
        else:
            hi = n
        if hi is not None and hi - lo <= 1:
            break
        # next: where the measured total meets `usable` at the KV bytes a page per sequence adds (a refusal, whose
        # total is unknown: halfway), kept strictly inside (lo, hi)
        step = math.floor((usable - total) / (per_page * seqs)) if total is not None else None
        nxt = n + step if step is not None else (lo + hi) // 2 if hi is not None else 2 * n
        nxt = nxt if nxt != n else n + 1 if e.get("fits") else n - 1
        n = min(max(nxt, lo + 1), hi - 1) if hi is not None else max(nxt, lo + 1)
    if hlo_dir is not None:  # keep the largest fit's text as "pool decode", drop the others
        for k in tried:
            p = hlo_path(hlo_dir, stage, f"pool{k} decode")
            if best and k == str(best[0]) and p.exists():
                p.replace(hlo_path(hlo_dir, stage, "pool decode"))
            elif p.exists():
                p.unlink()
    return {"pages_per_seq": lo, "tokens_per_seq": lo * page, "exact": hi is not None and hi - lo == 1,
            "tried": tried, **({"decode": best[1]} if best and best[0] == lo else {})}


def table(doc: dict) -> str:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
    rows = [f"{doc['model']} on {doc['topology']}, {doc['groups']} layer groups; usable "
            f"{doc['usable_bytes'] / 2**30:.2f} GiB per device",
            f"{'stage':<10} {'step':<14} {'total':>7} {'weights':>7} {'KV':>6} {'GDN':>5} {'temp':>6} "
            f"{'headroom':>8} {'fits':>5} {'compile s':>9}"]
    for stage, s in doc["stages"].items():
        for step, e in s["steps"].items():
            rows.append(f"{stage:<10} {step:<14} {gib(e.get('total_bytes')):>7} {gib(e['weight_bytes']):>7} "
                        f"{gib(e['kv_bytes']):>6} {gib(e['gdn_state_bytes']):>5} {gib(e.get('temp_bytes')):>6} "
                        f"{gib(e.get('headroom_bytes')):>8} {str(e.get('fits')):>5} {e['compile_s']:>9.1f}"
                        + (f"  {e['error'][:60]}" if "error" in e else ""))
        if "largest_pool" in s:
            lp = s["largest_pool"]
            rows.append(f"{stage:<10} largest pool that fits: {lp['pages_per_seq']} pages of "
                        f"{doc['shape']['page_size']} = {lp['tokens_per_seq']} tokens a sequence"
                        + ("" if lp["exact"] else " (at least)"))
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen35_lib.aot sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-397b-a17b")
    p.add_argument("--stages", help="comma-separated stage names (default: the whole ladder; also google_baseline, "
                                    "tpu_inference_3050 and the layouts tp8_ep8, dp4_tp2_ep8: plan.LAYOUT_STAGES)")
    p.add_argument("--requests", type=int, default=SERVING.requests,
                   help="concurrent requests of the serving shape (default: %(default)s)")
    p.add_argument("--steps", help=f"comma-separated steps (default: all of {', '.join(STEP_NAMES)})")
    p.add_argument("--groups", type=int, help="layer groups to compile (default: the model's own depth)")
    p.add_argument("--json", help="write (and resume) the sweep document here")
    p.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a TPU compiler option, e.g. xla_tpu_enable_async_collective_merger=false (repeatable)")
    p.add_argument("--recipe", action="store_true",
                   help="add the public Ironwood Qwen3.5 recipe's XLA flags (aot.RECIPE_OPTIONS)")
    p.add_argument("--weight-layouts", choices=("default", "mxu"), default="mxu",
                   help="bf16 weights as the step's dots read them (mxu, the default: aot.mxu_format), or as "
                        "device_put leaves them")
    p.add_argument("--no-largest-pool", action="store_true",
                   help="skip the search for each stage's largest pool that fits (a few decode compiles a stage)")
    p.add_argument("--hlo-dir", help="also keep each step's optimized HLO text here, gzipped")
    a = p.parse_args(argv)
    if a.groups is not None and a.groups < 1:
        p.error(f"--groups must be >= 1, got {a.groups}")
    from qwen35_lib.aot import RECIPE_OPTIONS

    options = dict(RECIPE_OPTIONS) if a.recipe else {}
    for kv in a.xla_option:
        if "=" not in kv:
            p.error(f"--xla-option takes KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        options[k] = v
    steps = a.steps.split(",") if a.steps else STEP_NAMES
    shape = dataclasses.replace(SERVING, requests=a.requests)
    doc = sweep(a.model, a.stages.split(",") if a.stages else None, a.groups, a.json, options, shape=shape, steps=steps,
                weight_layouts=a.weight_layouts, largest=not a.no_largest_pool, hlo_dir=a.hlo_dir)
    print(table(doc))
    return 0
