"""`python -m qwen35_lib.bench kernels`: the `moe_matmul` implementations side by side, per batch size and dtype.

Each case is (tokens T, dtype) at the model's MoE shapes (qwen3.5-mini: 64 experts top-8, D 512, F 128): the
N = T * k token copies are routed by a random router and sorted by expert (the library's `route` and
`permute` dispatch), then every registered `moe_matmul` implementation runs the grouped SwiGLU on them.
Two baselines, not slot implementations (they never win):
- "dense matmul (equal FLOPs)": x_sorted [N, D] @ W [D, 3F], the useful FLOPs of the MoE (2 * T * k * 3 * D * F)
  in one plain matmul. Each implementation's `throughput_ratio_vs_dense` is its useful FLOP/s over this one's,
  measured in the same run; the acceptance figure is the default implementation's at 4096 tokens (target 0.5);
- "dense (all experts)": every expert on every token, masked by the routing weights (E / k times the FLOPs).
Pallas TPU kernels ("pallas", and megablox `gmm` for comparison) run only in interpret mode off a TPU: there
they are checked for numerics at each case and never timed (`numerics_only`); on a TPU they are timed.
`--tile-sweep` also times "tiled" at fixed tile sizes, to check `moe_xla.tile_rows`. `--write-choice` writes the
measured winner per case to `data/kernel_choice_cpu.json`, which backs the CPU default in
`qwen35_lib/kernels/registry.py`.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.bench.timing import environment, format_table, measure, warn_if_busy, write_json
from qwen35_lib.config import Config, get_config
from qwen35_lib.kernels import registry
from qwen35_lib.kernels.moe_pallas import moe_megablox
from qwen35_lib.kernels.moe_xla import moe_tiled, tile_rows
from qwen35_lib.model.moe import route

DESCRIPTION = "moe_matmul implementations (ragged_dot, tiled, ...) vs dense matmuls, decode and prefill sizes"
CHOICE_PATH = pathlib.Path(__file__).resolve().parents[2] / "data" / "kernel_choice_cpu.json"
REFERENCE = "ragged_dot"  # the slot's reference twin: every other implementation's output is compared to it
DENSE = "dense (all experts)"
DENSE_EQ = "dense matmul (equal FLOPs)"
MEGABLOX = "megablox gmm"
TPU_ONLY = ("pallas",)  # interpret mode off a TPU: numerics only
TARGET_RATIO = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3.5-mini", help="preset giving the MoE shapes (default: %(default)s)")
    p.add_argument("--tokens", default="8,64,512,4096", help="tokens per case, comma-separated (default: %(default)s)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="activation/weight dtypes (default: %(default)s)")
    p.add_argument("--impls", help="moe_matmul implementations to time (default: every registered one)")
    p.add_argument("--tile-sweep", default="", help="also time 'tiled' at these tile sizes, e.g. 16,32,64,128")
    p.add_argument("--no-dense", action="store_true", help="skip the dense all-experts baseline")
    p.add_argument("--no-interpret-check", action="store_true",
                   help="off a TPU, skip the interpret-mode numerics check of the Pallas kernels")
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
    requested = _split(args.impls) if args.impls else list(registry.available("moe_matmul"))
    unknown = set(requested) - set(registry.available("moe_matmul"))
    if unknown:
        raise ValueError(f"unknown moe_matmul implementations {sorted(unknown)}; registered: "
                         f"{', '.join(registry.available('moe_matmul'))}")
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
    default = registry.resolve_name("moe_matmul", "auto")
    acceptance = max(cases, key=lambda c: (c["tokens"], c["dtype"] == base.dtype))  # most tokens, model dtype
    ratios = acceptance["throughput_ratio_vs_dense"]
    per_case = ", ".join(f"{c['dtype']} T={c['tokens']}: {c['winner']}" for c in cases)
    print(f"\nwinner per case: {per_case}")
    print(f"overall (lowest geometric-mean time ratio to each case's winner): {summary['overall']}")
    print(f"useful FLOP/s vs a dense matmul of equal FLOPs, {acceptance['dtype']} T={acceptance['tokens']}: "
          + ", ".join(f"{n} {r:.2f}" for n, r in ratios.items())
          + f"; default on {jax.default_backend()}: {default} (target >= {TARGET_RATIO})")
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
        "environment": environment(loadavg_1m_before=load_before),
    }
    if args.write_choice:
        cases_brief = [{k: v for k, v in c.items() if k != "timings"} for c in cases]  # medians, not every repeat
        choice = dict(doc, cases=cases_brief, command=args.command_line)
        print(f"wrote {write_json(args.write_choice, choice)}", file=sys.stderr)
    return doc


def _case(cfg: Config, tokens: int, impls: list[str], tiles: list[int], dense: bool, numerics_only: list[str],
          on_tpu: bool, args) -> dict:
    """Time one (tokens, dtype) case; returns its JSON record (and prints its table)."""
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn
    x, weights, ids, w_gate_up, w_down = _inputs(cfg, tokens, args.seed)
    permute = registry.get("permute", cfg.permute_kernel)
    x_sorted, group_sizes, order = jax.jit(permute.dispatch, static_argnums=2)(x, ids, E)  # [N, D], [E], [N]
    N = x_sorted.shape[0]

    candidates, grouped = {}, {}
    for name in impls:
        grouped[name] = jax.jit(functools.partial(registry.get("moe_matmul", name), fp8_block=None))
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
        fn = moe_megablox if name == MEGABLOX else registry.get("moe_matmul", name)
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
    """x [N, D] @ w [D, 3F] -> [N, 3F] float32: the MoE's useful FLOPs as one dense matmul."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


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
