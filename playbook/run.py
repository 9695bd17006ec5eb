"""Execute notebooks with nbclient, one fresh `python3` kernel each, and export them to HTML with nbconvert.

Results contract: before executing notebook `<name>`, the builder creates the empty folder
`<out>/results/<name>/` and passes its path to the kernel as `$QWEN35_RESULTS_DIR`. A notebook MAY write JSON
files there (only when the variable is set; interactively it is not, and nothing is written). Each `<stem>.json`
found afterwards becomes `entry["results"][<stem>]`, quoted in the chapters as `{{ result: NN.<stem>.key }}`.

Figures contract: a code cell whose source has a line `# figure: NAME` names the first PNG it outputs. The builder
writes it to `<out>/figures/<notebook>-NAME.png` and lists it in `entry["figures"][NAME]`; a chapter shows it with
`{{ figure: NN.NAME }}` (playbook/results.py).
"""

from __future__ import annotations

import base64
import glob
import json
import os
import pathlib
import re
import sys
import threading
import time
from typing import Any

from tqdm import tqdm

from playbook import RESULTS_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of an IPython traceback, dropped from the error we report
FIGURE_MARK = re.compile(r"^# figure: ([\w\-]+)\s*$", re.M)  # in a code cell: its first PNG output is figure NAME
TRACEBACK = "Traceback (most recent call last)"  # a traceback printed to a cell's stdout or stderr


def notebook_paths(only: list[str] | None = None) -> list[pathlib.Path]:
    """The notebook sources (`NN_*.py`, jupytext py:percent), in order; `only` keeps those whose stem is listed."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    if only:
        unknown = set(only) - {p.stem for p in paths}
        if unknown:
            raise SystemExit(f"unknown notebooks {sorted(unknown)}; known: {[p.stem for p in paths]}")
        paths = [p for p in paths if p.stem in only]
    return paths


def accelerator_present() -> bool:
    """A TPU (or GPU) device file: the notebooks then run at that hardware's size."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or glob.glob("/dev/nvidia[0-9]*"))


def kernel_env(results_dir: pathlib.Path) -> dict[str, str]:
    """The kernel's environment: the checkout importable, results folder set, JAX free to find an accelerator."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env[RESULTS_ENV] = str(results_dir)
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # kernels compiling for TPU ahead of time share libtpu
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    if accelerator_present() and env.get("JAX_PLATFORMS") == "cpu":  # the Makefile's default for CPU machines
        del env["JAX_PLATFORMS"]
    return env


def title_of(nb: Any) -> str:
    """The first `# ` heading of a markdown cell."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


class Progress:
    """One line per notebook on stderr; on a terminal (one notebook at a time) a tqdm bar of its code cells too."""

    def __init__(self, total: int, live: bool):
        self.total, self.live, self.lock = total, live, threading.Lock()
        self.bars: dict[int, tqdm] = {}  # index -> the live bar of that notebook

    def start(self, index: int, name: str, cells: int) -> None:
        if self.live:
            self.bars[index] = tqdm(total=cells, desc=f"[{index}/{self.total}] {name}", unit="cell",
                                    file=sys.stderr, leave=False, dynamic_ncols=True)
        else:
            self._line(f"[{index}/{self.total}] {name}: started, {cells} code cells")

    def cell(self, index: int, name: str, done: int, cells: int, seconds: float) -> None:
        bar = self.bars.get(index)
        if bar is not None:
            bar.update(done - bar.n)

    def end(self, index: int, entry: dict[str, Any]) -> None:
        bar = self.bars.pop(index, None)
        if bar is not None:
            bar.close()
        status = "ok" if entry["status"] == "ok" else f"FAILED: {entry['error']}"
        self._line(f"[{index}/{self.total}] {entry['name']}: {entry['cells']} cells, {entry['seconds']:.1f} s, "
                   f"{status}")

    def _line(self, text: str) -> None:
        with self.lock:
            tqdm.write(text, file=sys.stderr)


def execute(path: pathlib.Path, out: pathlib.Path, timeout: int, progress: Progress, index: int) -> dict[str, Any]:
    """Run one notebook, write its executed HTML page, and return its entry of results.json."""
    import jupytext
    import nbclient

    nb = jupytext.read(path)
    results_dir = out / "results" / path.stem
    results_dir.mkdir(parents=True, exist_ok=True)
    for old in results_dir.glob("*.json"):
        old.unlink()
    cells = sum(c.cell_type == "code" for c in nb.cells)
    start, done = time.perf_counter(), 0
    took: list[tuple[float, int]] = []  # (seconds, code cell number): each cell's time, the first's kernel start in it

    def on_cell(cell: Any, cell_index: int, execute_reply: Any) -> None:
        nonlocal done
        done += 1
        now = time.perf_counter() - start
        took.append((now - sum(t for t, _ in took), done))
        progress.cell(index, path.stem, done, cells, now)

    progress.start(index, path.stem, cells)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout, on_cell_executed=on_cell,
                                     resources={"metadata": {"path": str(path.parent)}})
    error = None
    try:
        client.execute(env=kernel_env(results_dir))
    except Exception as e:  # a failing cell: keep the partial notebook, report the error
        lines = ANSI.sub("", str(e)).strip().splitlines()
        error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        raised = next((label for label, out in _outputs(nb) if out.get("output_type") == "error"), None)
        error += f" (in {raised})" if raised else ""
    error = error or (printed_errors(nb) or [None])[0]
    results = {}
    for f in sorted(results_dir.glob("*.json")):
        try:
            results[f.stem] = json.loads(f.read_text())
        except ValueError as e:
            error = error or f"{f.name} is not JSON: {e}"
    entry = dict(name=path.stem, title=title_of(nb), status="failed" if error else "ok",
                 seconds=round(time.perf_counter() - start, 2), cells=cells, html=f"notebook-{path.stem}.html",
                 error=error, results=results, figures=save_figures(nb, out, path.stem),
                 slowest_cells=[dict(cell=n, seconds=round(t, 2)) for t, n in sorted(took, reverse=True)[:3]])
    out.joinpath(entry["html"]).write_text(export_html(nb), encoding="utf-8")
    progress.end(index, entry)
    return entry


def _outputs(nb: Any) -> Any:
    """(`code cell N ('its first line')`, output) for each output of each code cell, N counted from 1 as the progress
    line counts cells."""
    n = 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            n += 1
            first = next((line for line in cell.source.splitlines() if line.strip()), "")[:60]
            for out in cell.get("outputs", []):
                yield f"code cell {n} ({first!r})", out


def printed_errors(nb: Any) -> list[str]:
    """Each executed code cell whose outputs hold an error its execution went on past: an `error` output (one IPython
    showed and did not raise) or a traceback printed to its stdout or stderr (`traceback.print_exc()`, an exception
    in a thread the cell started, whose hook prints it where the thread's output goes), as
    `code cell N ('its first line') printed a traceback: Name: message`, once a cell."""
    found: dict[str, str] = {}
    for label, out in _outputs(nb):
        if label in found:
            continue
        if out.get("output_type") == "error":
            found[label] = f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"
        elif out.get("output_type") == "stream" and TRACEBACK in out.get("text", ""):
            tail = ANSI.sub("", out["text"]).split(TRACEBACK)[-1].strip().splitlines()
            found[label] = next((line.strip() for line in reversed(tail)
                                 if re.match(r"[\w.]+(Error|Exception|Exit|Interrupt|Warning)\b", line)),
                                tail[-1].strip() if tail else "")
    return [f"{label} printed a traceback: {last}" for label, last in found.items()]


def save_figures(nb: Any, out: pathlib.Path, stem: str) -> dict[str, str]:
    """Each code cell marked `# figure: NAME`: its first PNG output written to `<out>/figures/<stem>-NAME.png`;
    {NAME: that path relative to `out`}. A marked cell that drew nothing (or failed) is left out: the chapter that
    quotes it shows it missing."""
    figures: dict[str, str] = {}
    for cell in nb.cells:
        mark = FIGURE_MARK.search(cell.source) if cell.cell_type == "code" else None
        if mark is None:
            continue
        png = next((o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})), None)
        if png is None:
            continue
        path = out / "figures" / f"{stem}-{mark.group(1)}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(png))
        figures[mark.group(1)] = f"figures/{path.name}"
    return figures


def export_html(nb: Any) -> str:
    """The executed notebook as one HTML page (outputs and figures embedded), also when a cell failed."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    return body
