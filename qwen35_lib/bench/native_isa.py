"""`python -m qwen35_lib.bench native-isa`: the native CPU kernels' ISA variants side by side, in one process.

Every variant this CPU runs (`kernels.native.build.host_isas()`: an AVX-512 machine runs the AVX2 build too) is built
and its handlers registered under their own custom-call targets; each case is then traced once per variant (the
variant chosen by `QWEN35_NATIVE_ISA` while it traces) and all are timed interleaved (`timing.measure`, the order
rotating from round to round), so the ratios between variants share one load. Cases, at the model's shapes
(qwen3.5-mini: D 512, 64 experts top-8 of F 128; GDN 4 key / 8 value heads of 64), float32, panel-packed weights
as the engine stores them:
- `moe decode`: the fused grouped SwiGLU (`moe_native_fused`) on 8 tokens: ~40 experts touched, each read once
  (GB/s of their weights: memory-bound);
- `moe prefill`: the same on 512 tokens (GFLOP/s of the useful FLOPs, 2 T k 3 D F: compute-bound);
- `dense rows`: 8 rows times a [512, 4096] weight (`dense_native.linear_packed`; GB/s of the weight);
- `gdn decode`: one decode step of 8 rows (`gdn_decode_native`; GB/s of the states read and written);
- `gdn verify`: one speculative verify step of 8 rows of 4 tokens (`gdn_verify_native`: 3 drafts; GB/s of each
  row's state read once and written 5 times, its 4 checkpoints and its slot).
The outputs of every variant are compared with the first one's (max |Δ|). `bench engine` and `bench vs-transformers`
measure the variants end to end with `--native-isa all` (one process each, one after the other).
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.bench.timing import BusyMonitor, environment, format_table, measure, warn_if_busy
from qwen35_lib.config import get_config

DESCRIPTION = "the native CPU kernels' ISA variants (AVX-512, AVX2, ...) side by side in one process, interleaved"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3.5-mini", help="preset giving the shapes (default: %(default)s)")
    p.add_argument("--isas", default="all", help="variants, comma-separated, or all (default: %(default)s: every "
                                                 "variant this CPU runs)")


@contextmanager
def _variant(isa: str):
    """`QWEN35_NATIVE_ISA` set to `isa` for the traces inside."""
    before = os.environ.get("QWEN35_NATIVE_ISA")
    os.environ["QWEN35_NATIVE_ISA"] = isa
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("QWEN35_NATIVE_ISA", None)
        else:
            os.environ["QWEN35_NATIVE_ISA"] = before


def cases(config, seed: int = 0) -> dict[str, tuple]:
    """{case: (fn, args, bytes or None, flops or None)}: the kernels and their operands (see the module)."""
    from qwen35_lib.kernels.dense import native as dense_native
    from qwen35_lib.kernels.gdn import native as gdn_native
    from qwen35_lib.kernels.moe import native as moe_native
    from qwen35_lib.kernels.native.packed import pack_panels

    D, E, k, F = config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_ffn
    keys = jax.random.split(jax.random.key(seed), 12)
    wgu = jax.random.normal(keys[0], (E, D, 2, F)) / np.sqrt(D)
    wd = jax.random.normal(keys[1], (E, F, D)) / np.sqrt(F)
    packed = (pack_panels(wgu, lead=1, k_dims=1), pack_panels(wd, lead=1, k_dims=1))
    out = {}
    for name, T in (("moe decode", 8), ("moe prefill", 512)):
        x = jax.random.normal(keys[2], (T, D))
        ids = jnp.argsort(jax.random.normal(keys[3], (T, E)), axis=1)[:, :k].astype(jnp.int32)  # k distinct experts
        weights = jax.nn.softmax(jax.random.normal(keys[4], (T, k)))
        touched = len(np.unique(np.asarray(ids)))
        fn = lambda x, ids, w, a, b: moe_native.moe_native_fused(x, ids, w, E, a, b, platform="cpu")
        out[name] = (fn, (x, ids, weights, *packed), 4 * touched * 3 * D * F if T <= 64 else None,
                     2 * T * k * 3 * D * F)
    N = 8 * D
    w = jax.random.normal(keys[5], (D, N)) / np.sqrt(D)
    out["dense rows"] = (dense_native.linear_packed, (jax.random.normal(keys[6], (8, D)), pack_panels(w)), 4 * D * N,
                         2 * 8 * D * N)
    Hk, Hv, dk, dv, rows = config.gdn_num_k_heads, config.gdn_num_v_heads, config.gdn_k_head_dim, \
        config.gdn_v_head_dim, 8
    q, kk = (jax.random.normal(keys[i], (rows, Hk, dk)) for i in (7, 8))
    v = jax.random.normal(keys[9], (rows, Hv, dv))
    g = -jax.nn.softplus(jax.random.normal(keys[10], (rows, Hv)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[11], (rows, Hv)))
    states = jax.random.normal(keys[0], (rows + 1, Hv, dk, dv)) / 8
    slot = jnp.arange(1, rows + 1, dtype=jnp.int32)
    gdn = lambda *a: gdn_native.gdn_decode_native(*a, platform="cpu")
    out["gdn decode"] = (gdn, (q, kk, v, g, beta, slot, jnp.ones((rows,), bool), states), 2 * 4 * rows * Hv * dk * dv,
                         None)
    V = 4  # tokens a row: 3 drafts and the token before them
    tok = lambda x: jnp.repeat(x, V, axis=0)  # [rows V, ...]: row i's tokens at [i V, i V + V)
    checkpoints = jnp.zeros((rows + 1, V, Hv, dk, dv), jnp.float32)
    verify = lambda *a: gdn_native.gdn_verify_native(*a, platform="cpu")
    out["gdn verify"] = (verify, (*map(tok, (q, kk, v, g, beta)), slot, jnp.ones((rows,), bool), states, checkpoints),
                         (1 + V + 1) * 4 * rows * Hv * dk * dv, None)
    return out


def run(args: argparse.Namespace) -> dict:
    """1. The variants (`--isas`); 2. per case, one jitted function per variant, traced under it; 3. all timed
    interleaved; 4. the table: ms, GB/s or GFLOP/s, the ratio to the first variant, max |Δ| to its output."""
    from qwen35_lib.bench import isa as isa_runner
    from qwen35_lib.kernels.native import build as native

    load_before = warn_if_busy()
    isas = isa_runner.variants(args.isas)
    config = get_config(args.model, dtype="float32")
    print(f"native kernels' ISA variants side by side: {', '.join(native.describe(v) for v in isas)}; "
          f"{config.name} shapes, float32, packed weights; median of {args.repeats}, interleaved, the order rotating, "
          f"{args.settle} untimed call(s) before each")
    rows, results = [], []
    with BusyMonitor() as monitor:
        for name, (fn, fargs, nbytes, flops) in cases(config).items():
            fns = {}
            for v in isas:
                jitted = jax.jit(lambda *a, fn=fn: fn(*a))  # a new function: jax's trace caches key on it
                with _variant(v):
                    text = jitted.lower(*fargs).as_text()
                    if v.replace("-", "_") not in text:
                        raise RuntimeError(f"{name}: the {v} handler is not in the traced program "
                                           f"({native.unavailable('moe') or 'not loaded'})")
                    jitted(*fargs)  # compiled under the variant: its target is in the executable
                fns[v] = lambda jitted=jitted, fargs=fargs: jitted(*fargs)
            timings, outputs = measure(fns, repeats=args.repeats, warmup=1, settle=args.settle, desc=name)
            first = jax.tree.leaves(outputs[isas[0]])
            for v in isas:
                t = timings[v].median
                diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(outputs[v]), first))
                rate = f"{nbytes / t / 1e9:.1f} GB/s" if nbytes else f"{flops / t / 1e9:.1f} GFLOP/s"
                rows.append([name, v, f"{1e3 * t:.3f}", rate, f"{timings[isas[0]].median / t:.2f}x", f"{diff:.1e}"])
                results.append({"case": name, "isa": v, "bytes": nbytes, "flops": flops, "max_abs_diff": diff,
                                "timing": timings[v].to_json()})
    load = monitor.result()
    print(format_table(["case", "ISA", "ms", "rate", f"speed vs {isas[0]}", f"max|Δ| vs {isas[0]}"], rows))
    print(f"load: {load['loadavg_1m_before']} before, {load['loadavg_1m_after']} after on {load['cores']} cores; "
          f"this process {100 * (load['cpu_share'] or 0):.0f}% of the cores, others "
          f"{load['others_cores'] if load['others_cores'] is None else round(load['others_cores'], 2)} cores "
          "(the variants share it: their ratios stand, the absolute rates do not when others held the cores)")
    return {"benchmark": "native-isa", "model": config.name, "isas": isas, "results": results, "load": load,
            "environment": environment(loadavg_1m_before=load_before)}
