"""Execute every notebook into HTML: `python -m playbook.build --out build/playbook [--only 00_architecture]`.

1. Find the notebooks: `notebooks/[0-9][0-9]_*.py` (jupytext py:percent, the sources of truth).
2. Execute each in a fresh `python3` kernel with nbclient, working directory `notebooks/`, the repository root on
   `PYTHONPATH` (and `ALLOW_MULTIPLE_LIBTPU_LOAD=1`, so ahead-of-time TPU compiles do not wait on libtpu's
   process lock), a per-cell timeout, and a cell counter on stderr as progress.
3. Export the executed notebook (outputs and figures embedded) to `<out>/<name>.html` with nbconvert, also when a
   cell failed (the error is in the page).
4. Write `<out>/index.html` linking the pages and `<out>/results.json`, then print a summary table. The exit
   status is 1 when any notebook failed.

Results contract: before executing notebook `<name>`, the builder creates the empty folder
`<out>/results/<name>/` and exports its path as `$QWEN35_RESULTS_DIR` to the kernel. A notebook MAY write JSON
files there (only when the variable is set; interactively it is not, and nothing is written). Each `<stem>.json`
found afterwards is merged into `results.json` as `notebooks[i]["results"][<stem>]`. `results.json` is
`{"jax": version, "python": version, "notebooks": [{"name", "title", "status": "ok"|"failed", "seconds",
"cells", "html", "error", "results"}]}`.
"""

from __future__ import annotations

import argparse
import html
import importlib.metadata
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

from playbook import RESULTS_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def notebook_paths(only: list[str] | None = None) -> list[pathlib.Path]:
    """The notebook sources, in order; `only` keeps those whose stem is listed."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    if only:
        unknown = set(only) - {p.stem for p in paths}
        if unknown:
            raise SystemExit(f"unknown notebooks {sorted(unknown)}; known: {[p.stem for p in paths]}")
        paths = [p for p in paths if p.stem in only]
    return paths


def _title(nb: Any) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def execute(path: pathlib.Path, out: pathlib.Path, timeout: int) -> dict[str, Any]:
    """Run one notebook, write its HTML page, and return its entry of results.json."""
    import jupytext
    import nbclient
    from nbconvert import HTMLExporter

    nb = jupytext.read(path)
    results_dir = out / "results" / path.stem
    results_dir.mkdir(parents=True, exist_ok=True)
    for old in results_dir.glob("*.json"):
        old.unlink()
    os.environ[RESULTS_ENV] = str(results_dir)
    code_cells = sum(c.cell_type == "code" for c in nb.cells)
    done = 0

    def progress(cell: Any, cell_index: int, execute_reply: Any) -> None:
        nonlocal done
        done += 1
        print(f"\r  {path.stem}: cell {done}/{code_cells}", end="", file=sys.stderr, flush=True)

    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}}, on_cell_executed=progress)
    start, error = time.perf_counter(), None
    try:
        client.execute()
    except Exception as e:  # a failing cell: keep the partial notebook, report the error
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    seconds = time.perf_counter() - start
    print(file=sys.stderr)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    page = out / f"{path.stem}.html"
    page.write_text(body, encoding="utf-8")
    results = {f.stem: json.loads(f.read_text()) for f in sorted(results_dir.glob("*.json"))}
    return dict(name=path.stem, title=_title(nb), status="failed" if error else "ok", seconds=round(seconds, 2),
                cells=code_cells, html=page.name, error=error, results=results)


def write_index(out: pathlib.Path, entries: list[dict[str, Any]]) -> None:
    rows = "\n".join(
        f"<tr><td><a href=\"{html.escape(e['html'])}\">{html.escape(e['name'])}</a></td>"
        f"<td>{html.escape(e['title'])}</td><td>{e['status']}</td><td>{e['seconds']:.1f} s</td></tr>"
        for e in entries)
    out.joinpath("index.html").write_text(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Qwen3.5-397B on TPU7x: the playbook</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{padding:.3em 1em;text-align:left}"
        "</style></head><body><h1>Serving Qwen3.5-397B-A17B on TPU7x: the playbook</h1>"
        f"<table><tr><th>notebook</th><th>question</th><th>status</th><th>time</th></tr>\n{rows}\n</table>"
        "<p>Executed by <code>python -m playbook.build</code>; numbers per notebook in "
        "<a href=\"results.json\">results.json</a>.</p></body></html>\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m playbook.build", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/playbook", help="output folder (default: build/playbook)")
    parser.add_argument("--only", nargs="+", help="notebook names to build (default: all)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default: 600)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # kernels compiling for TPU ahead of time share libtpu
    paths = notebook_paths(args.only)
    entries = []
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path.stem}", file=sys.stderr, flush=True)
        entries.append(execute(path, out, args.timeout))
    summary = dict(jax=importlib.metadata.version("jax"), python=platform.python_version(), notebooks=entries)
    out.joinpath("results.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_index(out, entries)
    width = max([len(e["name"]) for e in entries] + [8])
    print(f"{'notebook':<{width}}  {'status':<6}  {'seconds':>8}  error")
    for e in entries:
        print(f"{e['name']:<{width}}  {e['status']:<6}  {e['seconds']:>8.1f}  {e['error'] or ''}")
    print(f"{sum(e['status'] == 'ok' for e in entries)}/{len(entries)} ok; site: {out / 'index.html'}")
    return 0 if all(e["status"] == "ok" for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
