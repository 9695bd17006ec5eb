"""Every notebook executes, its .ipynb twin is in sync and output-free, and its Colab links name the repository."""

from __future__ import annotations

import pathlib
import re

import jupytext
import nbclient
import nbformat
import pytest

from playbook import COLAB_URL, GITHUB_REPO, RESULTS_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
CELL_TIMEOUT = 300  # seconds per cell; a whole notebook should take under 60 s at CPU size


def _ids(path: pathlib.Path) -> str:
    return path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_runs(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports the checkout's qwen35_lib
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    # libtpu (ahead-of-time TPU compiles) takes a process lock; this pytest process may already hold it
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()


def _cells(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_ipynb_in_sync_and_without_outputs(path: pathlib.Path) -> None:
    twin = path.with_suffix(".ipynb")
    assert twin.exists(), f"{twin.name} is missing: run `jupytext --sync {path.relative_to(ROOT)}`"
    ipynb = nbformat.read(twin, as_version=4)
    assert _cells(jupytext.read(path)) == _cells(ipynb), \
        f"{twin.name} differs from {path.name}: run `jupytext --sync {path.relative_to(ROOT)}`"
    for cell in ipynb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{twin.name} has outputs: clear them"
    assert ipynb.metadata.get("kernelspec", {}).get("name") == "python3"
    assert "py:percent" in ipynb.metadata.get("jupytext", {}).get("formats", "")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_colab_badge_and_install_cell_name_the_repository(path: pathlib.Path) -> None:
    text = path.read_text()
    assert COLAB_URL.format(repo=GITHUB_REPO, name=path.stem) in text, "Colab badge missing or wrong"
    assert re.search(rf'^REPO = "{re.escape(GITHUB_REPO)}"$', text, re.M), "install cell must set REPO"
    assert not path.name.startswith("test_")
