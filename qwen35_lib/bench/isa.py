"""`--native-isa`: a benchmark run once per ISA variant of the native CPU kernels, and their figures side by side.

The native kernels are built per instruction set (`kernels.native.build.ISAS`: `x86-64-v4` AVX-512, `x86-64-v3` AVX2,
`aarch64` NEON) and the variant is chosen per process (`QWEN35_NATIVE_ISA`, else the best this CPU runs). So that
one command measures every variant this machine runs (an AVX-512 machine runs the AVX2 build too):
1. for each variant (`--native-isa x86-64-v3,x86-64-v4`, or `all`: `native.host_isas()`), the same benchmark command
   runs in a child process with `QWEN35_NATIVE_ISA` set and its own `--json` (next to this one's:
   `engine.x86-64-v3.json`), printing its tables as usual (each child compares with transformers side by side and
   measures its own floors, in its own run);
2. then one table: each variant's key figures (`FIGURES` of the benchmark) and their ratio to the first variant's,
   with the load average each child saw; the variants ran one after the other, not interleaved, so the cross-variant
   ratios carry whatever the load did in between (the shares of the floor and the ratios to transformers, each
   measured within one child, do not).
Every benchmark's JSON records the variant that ran (`environment()["native_isa"]`).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any, Callable

from qwen35_lib.bench.timing import format_table

HELP = ("run the benchmark once per native-kernel ISA variant, each in its own process (QWEN35_NATIVE_ISA), then "
        "print their figures side by side: a comma-separated list (x86-64-v4, x86-64-v3, aarch64; aliases avx512, "
        "avx2, neon) or 'all' (every variant this CPU runs)")


def variants(text: str) -> list[str]:
    """The variants `--native-isa` names: `all` -> those this CPU runs, best first; else each name resolved and
    checked to run here (ValueError naming what does)."""
    from qwen35_lib.kernels.native import build as native

    here = list(native.host_isas())
    if text.strip() == "all":
        if not here:
            raise ValueError(f"--native-isa all: {native.isa_problem() or 'no native ISA runs here'}")
        return here
    out = [native.resolve(v) for v in text.split(",") if v.strip()]
    for v in out:
        if v not in here:
            raise ValueError(f"--native-isa {v}: this CPU does not run it (it runs {', '.join(here) or 'none'})")
    if not out:
        raise ValueError("--native-isa is empty: name variants (x86-64-v3,x86-64-v4) or 'all'")
    return list(dict.fromkeys(out))


def child_argv(argv: list[str], json_path: str) -> list[str]:
    """`argv` without `--native-isa` and `--json` (either form), with `--json json_path`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--native-isa", "--json"):
            skip = True
            continue
        if a.startswith(("--native-isa=", "--json=")):
            continue
        out.append(a)
    return [*out, "--json", json_path]


def run_variants(name: str, argv: list[str], json_path: str, isas: list[str]) -> dict:
    """Run benchmark `name` (its command line `argv`, after `python -m qwen35_lib.bench`) once per variant; print the
    side-by-side table; return {"benchmark", "native_isas", "variants": {isa: its document}, "summary"}."""
    out = pathlib.Path(json_path)
    docs: dict[str, dict] = {}
    for isa in isas:
        path = out.with_name(f"{out.stem}.{isa}{out.suffix or '.json'}")
        cmd = [sys.executable, "-m", "qwen35_lib.bench", *child_argv(argv, str(path))]
        print(f"\n=== native kernels {isa}: QWEN35_NATIVE_ISA={isa} {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, env=dict(os.environ, QWEN35_NATIVE_ISA=isa))
        if done.returncode != 0:
            raise RuntimeError(f"the {isa} run of {name} failed (exit {done.returncode}); its output is above")
        docs[isa] = json.loads(path.read_text())
    summary = {isa: FIGURES.get(name, _no_figures)(doc) for isa, doc in docs.items()}
    print_side_by_side(name, summary)
    return {"benchmark": name, "native_isas": isas, "variants": docs, "summary": summary}


def print_side_by_side(name: str, summary: dict[str, dict[str, Any]]) -> None:
    """One row per figure, one column per variant (and its ratio to the first variant's where numeric)."""
    isas = list(summary)
    keys = list(dict.fromkeys(k for s in summary.values() for k in s))
    rows = []
    for k in keys:
        vals = [summary[i].get(k) for i in isas]
        row = [k, *(_fmt(v) for v in vals)]
        if len(isas) > 1:
            first = vals[0]
            row.append(", ".join(f"{v / first:.2f}x" if _num(v) and _num(first) and first else "-" for v in vals[1:]))
        rows.append(row)
    heads = ["figure", *isas, *([f"ratio to {isas[0]}"] if len(isas) > 1 else [])]
    print(f"\n{name}: the native kernels' ISA variants side by side (each measured in its own process, one after "
          "the other; a share of a floor or a ratio to transformers is within one run; 'load' is the 1-minute "
          "load average each run saw):")
    print(format_table(heads, rows))
    sys.stdout.flush()


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _get(d: Any, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _engine(doc: dict) -> dict:
    """The engine's figures per run (workload, concurrency): decode and prefill steps beside their floors (the
    profiled replay), the decode roofline, throughput; and the comparison with transformers."""
    out: dict[str, Any] = {"native_isa": _get(doc, "environment", "native_isa")}
    for r in doc.get("runs", []):
        tag = f"{r['workload']} N={r['concurrency']}"
        for kind in ("decode", "prefill"):
            p = _get(r, "profile", kind)
            if p:
                out[f"{tag} {kind} executable ms (profiled)"] = p.get("executable_ms")
                out[f"{tag} {kind} floor ms"] = p.get("floor_ms")
                out[f"{tag} {kind} share of its floor"] = p.get("floor_of_executable")
            out[f"{tag} {kind} step p50 ms (jitted)"] = _get(r, "per_step", kind, "jitted_ms", "p50")
        out[f"{tag} decode roofline share (jitted)"] = _get(r, "decode_roofline", "fraction_of_jitted")
        out[f"{tag} output tok/s"] = r.get("output_tokens_per_s")
        out[f"{tag} load before / after"] = (f"{_get(r, 'load', 'loadavg_1m_before')} / "
                                             f"{_get(r, 'load', 'loadavg_1m_after')}")
    vs = doc.get("vs_transformers")
    if vs:
        out["vs transformers: ours / HF output tok/s"] = None if _get(vs, "load", "withhold_ratios") \
            else vs.get("speedup")
        out["vs transformers: first 32 tokens identical"] = (f"{_get(vs, 'greedy_match', 'first_32_identical')}/"
                                                             f"{vs.get('requests')}")
        out["vs transformers: load before / after"] = (f"{_get(vs, 'load', 'loadavg_1m_before')} / "
                                                       f"{_get(vs, 'load', 'loadavg_1m_after')}")
    return out


def _vs_transformers(doc: dict) -> dict:
    """Per prefill shape: our ms, our share of the matmul roofline, ours / transformers; the geometric mean."""
    out: dict[str, Any] = {"native_isa": _get(doc, "environment", "native_isa")}
    for s in doc.get("shapes", []):
        tag = f"{s['batch']}x{s['seq']}"
        out[f"{tag} ours ms"] = 1e3 * s["timings"]["ours"]["median_s"]
        out[f"{tag} share of the matmul peak, ours"] = _get(s, "matmul_roofline", "ours")
        out[f"{tag} share of the matmul peak, HF"] = _get(s, "matmul_roofline", "transformers")
        out[f"{tag} ours / HF"] = None if doc.get("ratios_withheld") else s.get("speedup")
    out["geomean ours / HF"] = None if doc.get("ratios_withheld") else doc.get("geomean_speedup")
    out["matmul peak GFLOP/s"] = doc.get("matmul_gflop_s")
    out["load before / after"] = f"{_get(doc, 'load', 'loadavg_1m_before')} / {_get(doc, 'load', 'loadavg_1m_after')}"
    return out


def _no_figures(doc: dict) -> dict:
    return {"native_isa": _get(doc, "environment", "native_isa")}


FIGURES: dict[str, Callable[[dict], dict]] = {"engine": _engine, "vs-transformers": _vs_transformers}
