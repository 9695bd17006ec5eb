"""`python -m qwen35_lib.bench kernels`: the `moe_matmul` implementations side by side, per batch size and dtype.

Each case is (tokens T, dtype) at the model's MoE shapes (qwen3.5-mini: 64 experts top-8, D 512, F 128): the
N = T * k token copies are routed by a random router and sorted by expert (the library's `route` and
`permute` dispatch), then every registered `moe_matmul` implementation runs the grouped SwiGLU on them, and beside
them the library's forms that are no slot implementation (`bench.kernels_moe.VARIANTS`: `tiled`, `blocked`).
Two baselines, not slot implementations (they never win):
- "dense matmul (equal FLOPs)": x_sorted [N, D] @ W [D, 3F], the useful FLOPs of the MoE (2 * T * k * 3 * D * F)
  in one plain matmul, accumulated in float32 and rounded to x's dtype as the slot's output is (on XLA:CPU the
  fastest way to a bf16 result: a dot that outputs bf16 directly runs ~2x slower). Each implementation's
  `throughput_ratio_vs_dense` is its useful FLOP/s over this one's, measured in the same run; the acceptance
  figure is the default implementation's at 4096 tokens (target 0.5);
- "dense (all experts)": every expert on every token, masked by the routing weights (E / k times the FLOPs).
Pallas TPU kernels ("pallas", and megablox `gmm` for comparison: `bench.kernels_moe`) run only in interpret mode
off a TPU: there they are checked for numerics at each case and never timed (`numerics_only`); on a TPU they are timed.
Next to the MoE section, the same side-by-side figures for the `attention` slot (`kernels_attention.attention_rows`:
ragged paged attention vs `paged_attention_xla`) and the `gdn` slot (`kernels_gdn.gdn_rows`: the chunked and decode
kernels vs the XLA scan), at small CPU cases by default (`--no-attention`, `--no-gdn` skip them); off a TPU their
Pallas rows run in interpret mode and are labelled numerics-only (the time of an emulator, not of a TPU).
`--tile-sweep` also times "tiled" at fixed tile sizes, to check `moe_xla.tile_rows`. `--write-choice` writes the
measured winner per case to `data/kernel_choice_cpu.json`, which backs the CPU default in
`qwen35_lib/plan/kernels.py` (`BACKEND_DEFAULTS`).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib import data
from qwen35_lib.bench.kernels_moe import MEGABLOX, VARIANTS, moe_megablox
from qwen35_lib.bench.timing import environment, format_table, measure, warn_if_busy, write_json
from qwen35_lib.config import Config, get_config
from qwen35_lib.kernels import registry
from qwen35_lib.kernels.moe.xla import moe_tiled, tile_rows
from qwen35_lib.kernels.permute.pallas import combine_pallas, dispatch_pallas
from qwen35_lib.model.moe import route

DESCRIPTION = "moe_matmul implementations (ragged_dot, tiled, ...) vs dense matmuls, decode and prefill sizes"
CHOICE_PATH = data.path("kernel_choice_cpu.json")
REFERENCE = "ragged_dot"  # the slot's reference twin: every other implementation's output is compared to it
DENSE = "dense (all experts)"
DENSE_EQ = "dense matmul (equal FLOPs)"
TPU_ONLY = ("pallas",)  # interpret mode off a TPU: numerics only
TARGET_RATIO = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3.5-mini", help="preset giving the MoE shapes (default: %(default)s)")
    p.add_argument("--tokens", default="8,64,512,4096", help="tokens per case, comma-separated (default: %(default)s)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="activation/weight dtypes (default: %(default)s)")
    p.add_argument("--impls", help="moe_matmul implementations to time (default: every registered one and "
                                         f"{', '.join(VARIANTS)})")
    p.add_argument("--tile-sweep", default="", help="also time 'tiled' at these tile sizes, e.g. 16,32,64,128")
    p.add_argument("--no-dense", action="store_true", help="skip the dense all-experts baseline")
    p.add_argument("--no-interpret-check", action="store_true",
                   help="off a TPU, skip the interpret-mode numerics check of the Pallas kernels")
    p.add_argument("--no-attention", action="store_true", help="skip the attention side-by-side section")
    p.add_argument("--no-gdn", action="store_true", help="skip the GDN side-by-side section")
    p.add_argument("--gdn-prefill-tokens", type=int, default=None,
                   help="GDN prefill case length (default: 512 on a TPU, 128 in interpret mode)")
    p.add_argument("--gdn-decode-batch", type=int, default=None,
                   help="GDN decode rows (default: 32 on a TPU, 8 in interpret mode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-choice", nargs="?", const=str(CHOICE_PATH), metavar="PATH",
                   help=f"write the winner per case (default path: {CHOICE_PATH})")


def run(args: argparse.Namespace) -> dict:
    """1. For each (tokens, dtype): route random tokens, dispatch them, time every candidate side by side
       (off a TPU, the Pallas kernels run once in interpret mode instead: numerics only).
    2. Check every implementation against the reference twin; pick the fastest slot implementation.
    3. Useful FLOP/s over the equal-FLOP dense matmul's, per implementation; the acceptance case is the one with
       the most tokens (the model's dtype first), judged for the backend's default implementation.
    4. Print a table per case and a summary; write the choice file when asked; return the JSON document.
    """
    known = list(registry.available("moe_matmul")) + list(VARIANTS)
    requested = _split(args.impls) if args.impls else known
    unknown = set(requested) - set(known)
    if unknown:
        raise ValueError(f"unknown moe_matmul implementations {sorted(unknown)}; registered: "
                         f"{', '.join(registry.available('moe_matmul'))}; variants: {', '.join(VARIANTS)}")
    on_tpu = jax.default_backend() == "tpu"
    impls = [n for n in requested if on_tpu or n not in TPU_ONLY]  # timed
    numerics_only = [] if on_tpu or args.no_interpret_check else [n for n in requested if n in TPU_ONLY]
    if numerics_only:
        numerics_only.append(MEGABLOX)
    if not impls:
        raise ValueError(f"nothing to time: {', '.join(requested)} run only in interpret mode on "
                         f"{jax.default_backend()}")
    tiles = [int(t) for t in _split(args.tile_sweep)]
    load_before = warn_if_busy()
    base = get_config(args.model)
    print(f"moe_matmul on {jax.default_backend()} ({jax.devices()[0].device_kind}), {base.name} shapes: "
          f"{base.num_experts} experts top-{base.num_experts_per_tok}, D={base.hidden_size}, F={base.moe_ffn}; "
          f"median of {args.repeats}, interleaved, {args.settle} untimed call(s) before each")
    cases = []
    for dtype in _split(args.dtypes):
        for tokens in (int(t) for t in _split(args.tokens)):
            cases.append(_case(base.replace(dtype=dtype), tokens, impls, tiles, not args.no_dense, numerics_only,
                               on_tpu, args))
    summary = _summary(cases, impls)
    default = registry.default_name("moe_matmul")
    acceptance = max(cases, key=lambda c: (c["tokens"], c["dtype"] == base.dtype))  # most tokens, model dtype
    ratios = acceptance["throughput_ratio_vs_dense"]
    per_case = ", ".join(f"{c['dtype']} T={c['tokens']}: {c['winner']}" for c in cases)
    print(f"\nwinner per case: {per_case}")
    print(f"overall (lowest geometric-mean time ratio to each case's winner): {summary['overall']}")
    print(f"useful FLOP/s vs a dense matmul of equal FLOPs, {acceptance['dtype']} T={acceptance['tokens']}: "
          + ", ".join(f"{n} {r:.2f}" for n, r in ratios.items())
          + f"; default on {jax.default_backend()}: {default} (target >= {TARGET_RATIO})")
    sections = _attention_and_gdn(base.name, on_tpu, args)
    doc = {
        "benchmark": "kernels",
        "slot": "moe_matmul",
        "model": base.name,
        "shapes": {"num_experts": base.num_experts, "top_k": base.num_experts_per_tok, "hidden": base.hidden_size,
                   "moe_ffn": base.moe_ffn},
        "repeats": args.repeats,
        "settle": args.settle,
        "implementations": impls,
        "numerics_only": numerics_only,
        "default_implementation": default,
        "throughput_ratio_vs_dense": ratios,
        "acceptance": {"tokens": acceptance["tokens"], "dtype": acceptance["dtype"], "target": TARGET_RATIO,
                       "default_ratio": ratios.get(default), "met": ratios.get(default, 0.0) >= TARGET_RATIO},
        "default_tile_rule": "moe_xla.tile_rows(rows, experts)",
        "cases": cases,
        **summary,
        **sections,
        "environment": environment(loadavg_1m_before=load_before),
    }
    if args.write_choice:
        cases_brief = [{k: v for k, v in c.items() if k != "timings"} for c in cases]  # medians, not every repeat
        choice = dict(doc, cases=cases_brief, command=args.command_line)
        print(f"wrote {write_json(args.write_choice, choice)}", file=sys.stderr)
    return doc


def _impl(name: str):
    """A slot implementation by its registered name, or one of the variants (`VARIANTS`)."""
    return VARIANTS[name] if name in VARIANTS else registry.get("moe_matmul", name)


def _case(cfg: Config, tokens: int, impls: list[str], tiles: list[int], dense: bool, numerics_only: list[str],
          on_tpu: bool, args) -> dict:
    """Time one (tokens, dtype) case; returns its JSON record (and prints its table)."""
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn
    x, weights, ids, w_gate_up, w_down = _inputs(cfg, tokens, args.seed)
    permute = registry.get("permute", registry.default_name("permute"))
    x_sorted, group_sizes, order = jax.jit(permute.dispatch, static_argnums=2)(x, ids, E)  # [N, D], [E], [N]
    N = x_sorted.shape[0]

    candidates, grouped = {}, {}
    for name in impls:
        grouped[name] = jax.jit(functools.partial(_impl(name), fp8_block=None))
    for m in tiles:
        grouped[f"tiled m={m}"] = jax.jit(functools.partial(moe_tiled, tile=m))
    if on_tpu:
        grouped[MEGABLOX] = jax.jit(moe_megablox)
    for name, fn in grouped.items():
        candidates[name] = functools.partial(fn, x_sorted, group_sizes, w_gate_up, w_down)
    w_eq = (0.02 * jax.random.normal(jax.random.key(args.seed + 1), (D, 3 * F))).astype(x.dtype)  # [D, 3F]
    candidates[DENSE_EQ] = functools.partial(jax.jit(_dense_matmul), x_sorted, w_eq)
    if dense:
        gate = jnp.zeros((tokens, E), jnp.float32).at[jnp.arange(tokens)[:, None], ids].add(weights)  # [T, E]
        candidates[DENSE] = functools.partial(jax.jit(_dense_all_experts), x, gate, w_gate_up, w_down)
    timings, outputs = measure(candidates, repeats=args.repeats, settle=args.settle, desc=f"{cfg.dtype} T={tokens}")

    for name in numerics_only:  # interpret mode: run once, never timed
        fn = moe_megablox if name == MEGABLOX else _impl(name)
        outputs[name] = jax.jit(fn)(x_sorted, group_sizes, w_gate_up, w_down)

    ref = outputs.get(REFERENCE)
    errors = {}
    if ref is not None:
        ref_tokens = permute.combine(ref, order, weights)  # [T, D]
        for name, y in outputs.items():
            if name != DENSE_EQ:
                errors[name] = float(jnp.max(jnp.abs((y - (ref_tokens if name == DENSE else ref)).astype(jnp.float32))))
    flops = {name: 6 * (tokens * E if name == DENSE else N) * D * F for name in candidates}
    winner = min(impls, key=lambda n: timings[n].median)
    ratio_vs_dense = {n: timings[DENSE_EQ].median / timings[n].median for n in candidates if n not in (DENSE, DENSE_EQ)}
    record = {
        "tokens": tokens,
        "rows": N,
        "dtype": cfg.dtype,
        "default_tile": tile_rows(N, E),
        "group_sizes": {"min": int(group_sizes.min()), "max": int(group_sizes.max()), "mean": N / E},
        "winner": winner,
        "median_ms": {n: t.median * 1e3 for n, t in timings.items()},
        "ratio_to_winner": {n: t.median / timings[winner].median for n, t in timings.items()},
        "gflops_per_s": {n: flops[n] / timings[n].median / 1e9 for n in candidates},
        "useful_gflop": flops[DENSE_EQ] / 1e9,
        "throughput_ratio_vs_dense": ratio_vs_dense,
        f"max_abs_diff_vs_{REFERENCE}": errors,
        "timings": {n: t.to_json() for n, t in timings.items()},
    }
    rows = [[n + (" *" if n == winner else ""), record["median_ms"][n], record["ratio_to_winner"][n],
             record["gflops_per_s"][n], ratio_vs_dense.get(n, "-"), errors.get(n, "-")] for n in candidates]
    rows += [[f"{n} (interpret: numerics only)", "-", "-", "-", "-", errors.get(n, "-")] for n in numerics_only]
    print(f"\n{cfg.dtype}, T={tokens} tokens -> N={N} rows (groups {record['group_sizes']['min']}.."
          f"{record['group_sizes']['max']}, default tile {record['default_tile']})")
    print(format_table(["implementation", "median ms", "x winner", "GFLOP/s", "vs dense", f"max|Δ| vs {REFERENCE}"],
                       rows))
    return record


# Interpret mode is an emulator (seconds per call at CPU size): small cases off a TPU, the full ones on a TPU.
ATTENTION_CASES_INTERPRET = {"4 decodes x ctx 256 + a 64-token chunk at 192": ([256] * 4, [(192, 64)])}
INTERPRET_NOTE = ("Pallas rows off a TPU run in interpret mode: numerics only; their time is an emulator's, "
                  "not a TPU's")


def _attention_and_gdn(model: str, on_tpu: bool, args) -> dict:
    """The `attention` and `gdn` sections: Pallas vs the XLA twin, side by side (rows as `attention_rows` and
    `gdn_rows` return them), printed as tables."""
    from qwen35_lib.bench.kernels_attention import attention_rows
    from qwen35_lib.bench.kernels_gdn import gdn_rows

    out = {}
    if not args.no_attention:
        rows = attention_rows(model, cases=None if on_tpu else ATTENTION_CASES_INTERPRET, repeats=args.repeats,
                              seed=args.seed)
        out["attention"] = {"slot": "attention", "reference": "xla", "note": INTERPRET_NOTE, "rows": rows}
        print(f"\nattention (paged): Pallas ragged paged attention and the XLA one by items vs paged_attention_xla, "
              f"{model}")
        print(format_table(["case", "implementation", "mode", "median ms", "vs xla", "max|Δ| vs xla"],
                           [[r["case"], r["implementation"], r["mode"], r["median_ms"], r["throughput_ratio_vs_xla"],
                             r["max_abs_diff_vs_xla"]] for r in rows]))
    if not args.no_gdn:
        prefill = args.gdn_prefill_tokens or (512 if on_tpu else 128)
        batch = args.gdn_decode_batch or (32 if on_tpu else 8)
        rows = gdn_rows(model, prefill_tokens=prefill, decode_batch=batch, repeats=args.repeats,
                        settle=args.settle, seed=args.seed)
        out["gdn"] = {"slot": "gdn", "reference": "xla", "note": INTERPRET_NOTE, "rows": rows}
        native = " (and the native C++ ones, on the CPU)" if any(r["implementation"] == "native" for r in rows) else ""
        print(f"\ngdn: Pallas chunk and decode kernels{native} vs the XLA gated delta rule, {model}")
        print(format_table(["case", "shape", "implementation", "mode", "median ms", "vs xla", "max|Δ| vs xla"],
                           [[r["case"], r["shape"], r["implementation"], r["mode"], r["median_ms"],
                             r["speedup_vs_xla"], r["max_abs_diff_vs_xla"]] for r in rows]))
    return out


def _inputs(cfg: Config, tokens: int, seed: int) -> tuple[jax.Array, ...]:
    """Random tokens x [T, D], routed by a random router (weights, ids [T, k]); expert weights (std 0.02)."""
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn
    dt = jnp.dtype(cfg.dtype)
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (tokens, D), jnp.float32).astype(dt)
    router = (0.02 * jax.random.normal(keys[1], (D, E))).astype(dt)
    w_gate_up = (0.02 * jax.random.normal(keys[2], (E, D, 2, F))).astype(dt)
    w_down = (0.02 * jax.random.normal(keys[3], (E, F, D))).astype(dt)
    weights, ids = jax.jit(functools.partial(route, cfg))(router, x)
    return x, weights, ids, w_gate_up, w_down


def _dense_matmul(x, w):
    """x [N, D] @ w [D, 3F] -> [N, 3F] in x's dtype: the MoE's useful FLOPs as one dense matmul."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _dense_all_experts(x, gate, w_gate_up, w_down):
    """Every expert on every token, weighted by `gate` [T, E] (zero off the top-k). x: [T, D] -> [T, D] float32."""
    h = jnp.einsum("td,edcf->ectf", x, w_gate_up, preferred_element_type=jnp.float32)  # [E, 2, T, F]
    a = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x.dtype)  # [E, T, F]
    # batch dim leading: XLA:CPU cannot run a bf16 x bf16 -> f32 dot whose batch dim is not leading ("tef,efd")
    y = jnp.einsum("etf,efd->etd", a, w_down, preferred_element_type=jnp.float32)  # [E, T, D]
    return jnp.einsum("etd,te->td", y, gate)


def _summary(cases: list[dict], impls: list[str]) -> dict:
    """Wins per implementation and the overall pick: the lowest geometric mean of time / the case's winner."""
    wins = {n: sum(c["winner"] == n for c in cases) for n in impls}
    geo = {n: math.exp(np.mean([math.log(c["ratio_to_winner"][n]) for c in cases])) for n in impls}
    return {"wins": wins, "geomean_ratio_to_winner": geo, "overall": min(impls, key=geo.__getitem__)}


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


# --- side by side per kernel: the XLA twin vs the Pallas kernel (notebook 05; `run` adds attention and GDN) ------
def interpret_label() -> str:
    """What an interpret-mode Pallas row's time is, on the backend it ran on (a CPU, or a GPU runtime)."""
    return f"pallas interpret ({jax.default_backend().upper()}: numerics only, not a speed)"


def _mode(name: str) -> str:
    if name != "pallas":
        return f"xla ({jax.default_backend()})"
    return "pallas compiled" if jax.default_backend() == "tpu" else interpret_label()


def _side_by_side(kernel: str, case: str, candidates: dict, repeats: int, settle: int, **extra) -> list[dict]:
    """Time `candidates` {name: zero-arg callable -> array} interleaved; the first is the reference twin. One row
    per implementation: median_ms, speedup_vs_xla (reference median / this median), max_abs_diff_vs_xla."""
    timings, outputs = measure(candidates, repeats=repeats, settle=settle, desc=f"{kernel} {case}")
    ref_name = next(iter(candidates))
    ref = jnp.asarray(outputs[ref_name], jnp.float32)
    return [{"kernel": kernel, "case": case, "implementation": name, "mode": _mode(name),
             "backend": jax.default_backend(), "median_ms": t.median * 1e3,
             "speedup_vs_xla": timings[ref_name].median / t.median,
             "max_abs_diff_vs_xla": float(jnp.max(jnp.abs(jnp.asarray(outputs[name], jnp.float32) - ref))), **extra}
            for name, t in timings.items()]


def moe_rows(model: str = "qwen3.5-mini", tokens: int = 64, dtype: str = "float32", repeats: int = 3,
             settle: int = 1, seed: int = 0) -> list[dict]:
    """The `moe_matmul` slot's default (the backend's "auto" unless that is Pallas: then `ragged_dot`) vs the
    Pallas grouped GEMM on the same sorted token copies (routed by a random router, dispatched by `permute`).
    Row keys as `_side_by_side`, plus rows (token copies), useful_flops (2 * rows * 3 * D * F)."""
    cfg = get_config(model, dtype=dtype)
    x, _, ids, w_gate_up, w_down = _inputs(cfg, tokens, seed)
    dispatch = jax.jit(registry.get("permute", "xla").dispatch, static_argnums=2)
    x_sorted, group_sizes, _ = dispatch(x, ids, cfg.num_experts)  # [N, D], [E]
    default = registry.default_name("moe_matmul")
    twin = default if default != "pallas" else REFERENCE
    fns = {n: jax.jit(functools.partial(registry.get("moe_matmul", n), fp8_block=None)) for n in (twin, "pallas")}
    N = int(x_sorted.shape[0])
    return _side_by_side("moe_matmul", f"T={tokens} x top-{cfg.num_experts_per_tok} = {N} rows",
                         {n: functools.partial(f, x_sorted, group_sizes, w_gate_up, w_down) for n, f in fns.items()},
                         repeats, settle, model=model, dtype=dtype, rows=N,
                         useful_flops=6 * N * cfg.hidden_size * cfg.moe_ffn)


def permute_rows(model: str = "qwen3.5-mini", tokens: int = 64, dtype: str = "float32", repeats: int = 3,
                 settle: int = 1, seed: int = 0) -> list[dict]:
    """The `permute` slot, XLA vs Pallas: dispatch (sort the T * k token copies by expert) then the weighted
    combine back to [T, D] (an identity expert in between), on the same routed tokens. Row keys as
    `_side_by_side`, plus bytes_moved (each copy's row read and written, both ways)."""
    cfg = get_config(model, dtype=dtype)
    x, weights, ids, _, _ = _inputs(cfg, tokens, seed)

    def round_trip(name, x, ids, weights):
        p = registry.get("permute", name)
        x_sorted, _, order = p.dispatch(x, ids, cfg.num_experts)
        return p.combine(x_sorted, order, weights)  # [T, D] = x * sum_j weights_j

    fns = {n: jax.jit(functools.partial(round_trip, n)) for n in ("xla", "pallas")}
    N = tokens * cfg.num_experts_per_tok
    return _side_by_side("permute", f"T={tokens} x top-{cfg.num_experts_per_tok}: dispatch + combine",
                         {n: functools.partial(f, x, ids, weights) for n, f in fns.items()}, repeats, settle,
                         model=model, dtype=dtype, rows=N, bytes_moved=4 * N * cfg.hidden_size * x.dtype.itemsize)


def compile_summary(rows: list[dict] | None, kernel: str) -> str:
    """One line for `kernel`'s row of `tpu7x_compile_rows` (None: libtpu was not there to compile)."""
    if rows is None:
        return "libtpu not installed (pip install 'jax[tpu]'): ahead-of-time compile skipped"
    r = next(r for r in rows if r["kernel"] == kernel)
    return (f"{kernel} compiled for {r['target']} at {r['model']} ({r['case']}): Mosaic kernel in the program: "
            f"{r['mosaic']}; arguments {r['argument_bytes'] / 2**20:,.0f} MiB, temporaries "
            f"{r['temp_bytes'] / 2**20:,.1f} MiB; {r['compile_s']:.1f} s")


def tpu7x_compile_rows(model: str = "qwen3.5-397b-a17b", seqs: int = 64, context: int = 9216, page_size: int = 256,
                       prefill_chunks: int = 4) -> list[dict]:
    """Each Pallas kernel lowered by Mosaic and compiled for one TPU7x core (`tpu7x:2x2x1` device 0, needs libtpu;
    nothing runs, nothing is allocated) at `model`'s shapes, for one data-parallel rank of a 512-request decode
    step: `seqs` sequences of `context` tokens in an FP8 paged KV cache, their MoE rows (seqs * top-k copies over
    8 devices' experts... every rank's tokens, as token replication does: 8 * seqs * k / 8 rows per device's
    E / 8 experts, FP8 block-scaled weights), the GDN ragged step (seqs decodes + `prefill_chunks` chunks), and
    the permutes of the rank's tokens. Returns rows {kernel, case, compile_s, mosaic (a Mosaic custom call is in
    the program), flops, bytes_accessed (XLA's cost_analysis: a prediction; a Mosaic call counts as its operand
    and result bytes plus its CostEstimate's FLOPs), temp_bytes, argument_bytes}."""
    import time

    from qwen35_lib.aot import topology_devices
    from qwen35_lib.engine.batch import RaggedMeta
    from qwen35_lib.kernels.attention.pallas import paged_attention_pallas
    from qwen35_lib.kernels.gdn.pallas import gdn_ragged_pallas
    from qwen35_lib.kernels.moe.pallas import moe_pallas
    from qwen35_lib.weights import BlockFP8

    cfg = get_config(model)
    one = jax.sharding.SingleDeviceSharding(topology_devices()[0])
    sds = lambda *shape, dt="bfloat16": jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=one)  # noqa: E731
    Hq, Hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    Hk, Hv, dk, dv, C = (cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim,
                         cfg.gdn_chunk_size)
    D, F, E, k, b = cfg.hidden_size, cfg.moe_ffn, cfg.num_experts, cfg.num_experts_per_tok, cfg.fp8_block_size
    n = context // page_size
    E_loc, rows = E // 8, seqs * k  # all 8 ranks' copies, spread over the 8 devices' experts
    T = seqs + prefill_chunks * C
    meta = RaggedMeta(*(sds(*s, dt="int32") for s in ((T,), (T,), (seqs,), (seqs,), (seqs,), (seqs, 4), (seqs,),
                                                        (seqs,), (seqs,))))
    programs = {
        ("attention", f"{seqs} decodes x {context} ctx, FP8 KV, pages of {page_size}"): (
            functools.partial(paged_attention_pallas, interpret=False),
            (sds(seqs, Hq, d), sds(seqs * n + 1, page_size, 2 * Hkv * d, dt="float8_e4m3fn"),
             sds(seqs * n + 1, 2 * Hkv, page_size, dt="float32"), sds(seqs, n, dt="int32"),
             sds(seqs, dt="int32"), sds(seqs, dt="int32")), {}),
        ("moe_matmul", f"{rows} rows, {E_loc} local experts, FP8 weights"): (
            functools.partial(moe_pallas, fp8_block=b, interpret=False),
            (sds(rows, D), sds(E, dt="int32"),
             BlockFP8(sds(E_loc, D, 2 * F, dt="float8_e4m3fn"), sds(E_loc, D // b, 2 * F // b, dt="float32")),
             BlockFP8(sds(E_loc, F, D, dt="float8_e4m3fn"), sds(E_loc, F // b, D // b, dt="float32"))),
            {"group_offset": sds(dt="int32")}),
        ("gdn", f"{seqs} decodes + {prefill_chunks} chunks of {C}, {seqs + 1} state slots"): (
            functools.partial(gdn_ragged_pallas, interpret=False),
            (sds(T, Hk, dk), sds(T, Hk, dk), sds(T, Hv, dv), sds(T, Hv, dt="float32"), sds(T, Hv, dt="float32"),
             sds(seqs + 1, Hv, dk, dv, dt=cfg.gdn_state_dtype), meta), {}),
        ("permute", f"dispatch + combine of {seqs} tokens x top-{k}"): (
            functools.partial(_round_trip_pallas, num_experts=E),
            (sds(seqs, D), sds(seqs, k, dt="int32"), sds(seqs, k)), {}),
    }
    out = []
    for (kernel, case), (fn, args, kwargs) in programs.items():
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args, **kwargs).compile()
        cost, mem = compiled.cost_analysis(), compiled.memory_analysis()
        out.append({"kernel": kernel, "case": case, "model": model, "target": "tpu7x:2x2x1 (one TensorCore)",
                    "compile_s": time.perf_counter() - t0, "mosaic": "tpu_custom_call" in compiled.as_text(),
                    "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
                    "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes})
    return out


def _round_trip_pallas(x, ids, weights, *, num_experts: int):
    """The Pallas permutes, compiled for real: dispatch then combine (an identity expert between)."""
    x_sorted, _, order = dispatch_pallas(x, ids, num_experts, interpret=False)
    return combine_pallas(x_sorted, order, weights, interpret=False)


SLOT_COMPONENT = {"attention": "attn_core", "moe_matmul": "routed_experts", "gdn": "gdn_core", "permute": "permute",
                  "dense": "dense"}


def _dense_projections(cfg, b, pr) -> dict:
    """{"dense": the `dense` slot's cost for one layer, averaged over the layer pattern}: attention's projections
    in the share of attention layers, GDN's in the share of GDN layers, and the shared expert and router of every
    layer's MoE (`costmodel.ops`)."""
    from qwen35_lib.costmodel import moe_costs, ops

    z = ops.sizes(cfg)
    n = z["n_attn"] + z["n_gdn"]
    moe = moe_costs.moe_block(cfg, b, pr)
    projections = (ops.attention_block(cfg, b, pr)["attn_proj"] * (z["n_attn"] / n)
                   + ops.gdn_block(cfg, b, pr)["gdn_proj"] * (z["n_gdn"] / n))
    return {"dense": projections + moe["shared_expert"] + moe["router"]}


def roofline_rows(model: str = "qwen3.5-397b-a17b", hardware: str = "tpu7x-8", concurrency: int = 512,
                  context: int = 9216, prefill_chunk: int = 2048) -> list[dict]:
    """Where each kernel sits on one device's roofline, per the cost model (`costmodel.ops`), XLA vs Pallas.

    1. Two whole-slice steps of the serving model (FP8 experts, FP8 KV cache): `decode` = `concurrency` decodes at a
       mean context of `context` / 2 (the longest `context`); `prefill` = one `prefill_chunk` chunk per rank at
       `context` / 2 tokens already cached.
    2. The pricings of the `hier_rs` stage (XLA kernels) and the `kernels` stage (Pallas), from `step.pricing`.
    3. Per kernel's component, one layer on one device: FLOPs, HBM bytes, arithmetic intensity (FLOPs per byte)
       against the ridge point (peak FLOP/s / HBM bytes/s), the bound, and the roofline seconds (`ops.seconds`).
    4. `dense` (the projections' slot): one layer's dense projections averaged over the model's layer pattern (its
       attention and GDN layers' projections in their proportion), plus the shared expert and the router every layer
       has; XLA's dots read the weights in the passes the stage's pricing charges (`weight_passes`), the Pallas
       projection in place.
    The cost model credits the GDN kernel with nothing over XLA at prefill (same bytes, same FLOPs): its rows say so
    by being equal.
    """
    from qwen35_lib.costmodel import moe_costs, ops, specs, step
    from qwen35_lib.costmodel.predict import serving_model
    from qwen35_lib.plan import get_stage

    cfg, sp = serving_model(model), specs.get(hardware)
    ridge = sp.peak_flops / sp.hbm_bytes_per_s
    dp = sp.devices
    batches = {"decode": ops.Batch(decodes=concurrency, decode_ctx=context / 2, max_ctx=context),
               "prefill": ops.Batch(prefill_tokens=dp * prefill_chunk, prefill_seqs=dp, prefill_ctx=context / 2,
                                    max_ctx=context)}
    blocks = {"attn_core": ops.attention_block, "gdn_core": ops.gdn_block, "routed_experts": moe_costs.moe_block,
              "permute": moe_costs.moe_block, "dense": _dense_projections}
    out = []
    for stage, impl in (("hier_rs", "xla"), ("kernels", "pallas")):
        pr = step.pricing(cfg, sp, get_stage(stage), kv_dtype="float8_e4m3fn")
        for case, b in batches.items():
            for kernel, comp in SLOT_COMPONENT.items():
                c = blocks[comp](cfg, b, pr)[comp]
                ai = c.flops / c.hbm_bytes if c.hbm_bytes else float("inf")
                out.append({"kernel": kernel, "case": case, "implementation": impl, "stage": stage, "model": cfg.name,
                            "hardware": sp.name, "flops": c.flops, "hbm_bytes": c.hbm_bytes, "intensity": ai,
                            "ridge": ridge, "bound": "compute" if ai >= ridge else "memory",
                            "seconds": ops.seconds(c, sp), "peak_flops": sp.peak_flops,
                            "hbm_bytes_per_s": sp.hbm_bytes_per_s})
    return out
