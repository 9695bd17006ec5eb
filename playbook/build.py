"""Build the playbook site: `python -m playbook.build --out build/playbook [--only 00_architecture] [--jobs 2]`.

1. Find the notebooks, `notebooks/NN_*.py` (jupytext py:percent, the sources of truth), and execute each in a
   fresh `python3` kernel (playbook/run.py): working directory `notebooks/`, the checkout on `PYTHONPATH`, a
   per-cell timeout, `$QWEN35_RESULTS_DIR` for the JSON results it records, and a progress line per notebook.
   On a machine with an accelerator, `JAX_PLATFORMS=cpu` is dropped so the notebooks run at that hardware's size.
2. Export each executed notebook, outputs and figures embedded, to `<out>/notebook-NN_name.html` (also when a
   cell failed: the error is in the page).
3. Render the chapters `playbook/chapters/*.md`, filling each `{{ result: ... }}` from this run's results
   (playbook/results.py), and write the results page, `index.html` and `results.json` (playbook/site.py).
4. Print a summary: each notebook's status, time and slowest code cells (numbered as the progress line counts them,
   the first with the kernel's start), and the key results (the values the conclusion quotes).
   The exit status is 1 when a notebook failed (a cell raised, a claim it checks does not hold among others, or a
   cell went on past an error it printed: a traceback in its output, `run.printed_errors`), a chapter quotes a
   result or claim that was not produced, or a chapter's box compares with no claim behind it (playbook/claims.py).

`results.json` is `{"build": {...}, "jax": version, "python": version, "notebooks": [{"name", "title", "status":
"ok"|"failed", "seconds", "cells", "html", "error", "results": {stem: document}, "figures",
"slowest_cells": [{"cell": N, "seconds"}, ...]}]}`; a notebook's claims are its
`results["claims"]`: {name: {statement, text, holds, relation, values}}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import json
import os
import pathlib
import platform
import sys
import time

from playbook import claims, run, site


def run_notebooks(paths: list[pathlib.Path], out: pathlib.Path, timeout: int, jobs: int) -> list[dict]:
    progress = run.Progress(len(paths), live=jobs == 1 and sys.stderr.isatty())
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run.execute, p, out, timeout, progress, i) for i, p in enumerate(paths, 1)]
        return [f.result() for f in futures]


def summary(entries: list[dict], key_values: list[site.Value], errors: list[str], out: pathlib.Path,
            seconds: float) -> str:
    width = max([len(e["name"]) for e in entries] + [8])
    slowest = {e["name"]: ", ".join(f"{c['cell']}: {c['seconds']:.1f} s" for c in e.get("slowest_cells") or [])
               for e in entries}
    cw = max([len(v) for v in slowest.values()] + [len("slowest code cells")])
    lines = [f"{'notebook':<{width}}  {'status':<6}  {'seconds':>7}  {'slowest code cells':<{cw}}  error"]
    lines += [f"{e['name']:<{width}}  {e['status']:<6}  {e['seconds']:>7.1f}  {slowest[e['name']]:<{cw}}  "
              f"{e['error'] or ''}" for e in entries]
    unique = list({v.path: v for v in key_values}.values())
    if unique:
        width = max(len(v.path) for v in unique)
        lines += ["", f"{'key result (quoted by the conclusion)':<{width}}  value"]
        lines += [f"{v.path:<{width}}  {v.text if v.text is not None else 'missing: ' + v.reason}" for v in unique]
    lines += [f"\n{len(errors)} chapter error(s):", *errors] if errors else []
    ok = sum(e["status"] == "ok" for e in entries)
    lines.append(f"\n{ok}/{len(entries)} notebooks ok in {seconds:.0f} s; site: {out / 'index.html'}")
    return "\n".join(lines)


def failed_claims(entries: list[dict]) -> list[str]:
    """Each recorded claim that does not hold, as `claim NN.name does not hold: text` (a notebook that raised for it
    failed already; this also catches one that went on)."""
    return [f"claim {e['name'][:2]}.{name} does not hold: {c.get('text')}"
            for e in entries for name, c in ((e.get("results") or {}).get(claims.CLAIMS_KEY) or {}).items()
            if not c.get("holds")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m playbook.build", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/playbook", help="output folder (default: build/playbook)")
    parser.add_argument("--only", nargs="+", help="notebook names to run (default: all)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default: 600)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default: 1)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkout = [p.stem for p in run.notebook_paths()]
    entries = run_notebooks(run.notebook_paths(args.only), out, args.timeout, args.jobs)
    versions = dict(jax=importlib.metadata.version("jax"), python=platform.python_version())
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs" + (", accelerator" if run.accelerator_present() else "")
    build = site.build_info(machine=machine, **versions)
    out.joinpath("results.json").write_text(json.dumps(dict(build=build, **versions, notebooks=entries), indent=2)
                                            + "\n")
    key_values, errors = site.write_site(out, entries, build, checkout)
    errors += failed_claims(entries)
    print(summary(entries, key_values, errors, out, time.perf_counter() - start))
    return 0 if not errors and all(e["status"] == "ok" for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
