"""Every notebook's .ipynb twin is in sync and output-free, `pytest` executes each twin (nbmake), and its Colab
links name the repository. The execution itself is nbmake's item `notebooks/NN_*.ipynb` (the root conftest.py
sets its kernel's environment)."""

from __future__ import annotations

import pathlib
import re

import jupytext
import nbformat
import pytest

from playbook import COLAB_URL, GITHUB_REPO

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def _ids(path: pathlib.Path) -> str:
    return path.name


def test_pytest_executes_every_notebook_once(pytestconfig: pytest.Config) -> None:
    """`pytest` (so `make test`) collects each paired .ipynb exactly once for nbmake, with a per-cell timeout."""
    assert pytestconfig.option.nbmake, "pytest runs the notebooks with nbmake: keep --nbmake in addopts"
    assert pytestconfig.option.nbmake_timeout <= 300
    collected = [p for pattern in pytestconfig.getini("testpaths") for p in sorted(ROOT.glob(pattern))]
    ipynb = [p for p in collected if p.suffix == ".ipynb"]
    assert ipynb == [p.with_suffix(".ipynb") for p in NOTEBOOKS], "testpaths must name notebooks/*.ipynb once"


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
    """`playbook.GITHUB_REPO` is the one place the repository is named: the badge opens this notebook there, and the
    install cell pip-installs from it (`$QWEN35_REPO`, a fork, overriding); the badge names no other repository."""
    text = path.read_text()
    assert COLAB_URL.format(repo=GITHUB_REPO, name=path.stem) in text, "Colab badge missing or wrong"
    badges = re.findall(r"colab\.research\.google\.com/github/([\w.\-]+/[\w.\-]+)/", text)
    assert badges and set(badges) == {GITHUB_REPO}, badges
    assert re.search(rf'^REPO = os.environ.get\("QWEN35_REPO"\) or "{re.escape(GITHUB_REPO)}"(  #.*)?$', text, re.M), \
        "the install line must name the repository, $QWEN35_REPO overriding it"
    assert "@ git+https://github.com/{REPO}'" in text, "the install URL must be built from REPO"
    assert not path.name.startswith("test_")


def _install_cell(path: pathlib.Path) -> str:
    return next(c.source for c in jupytext.read(path).cells if c.cell_type == "code" and "pip install" in c.source)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_the_install_cell_checks_pips_exit_status_and_shows_its_tail(path: pathlib.Path, monkeypatch, tmp_path):
    """On a runtime without the library (Colab) a failed pip stops the notebook there, with pip's exit status and
    its last lines; a pip that succeeds goes on silently, and a runtime with the library runs no pip at all."""
    import importlib.util
    import subprocess

    calls = []

    def pip(returncode):
        def run(cmd, **kw):
            calls.append(cmd)
            assert kw["stderr"] == subprocess.STDOUT  # pip's errors in its output, in order
            out = "".join(f"line {i}\n" for i in range(40)) + ("ERROR: No matching distribution\n" * bool(returncode))
            return subprocess.CompletedProcess(cmd, returncode, out, None)
        return run

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QWEN35_REPO", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(subprocess, "run", pip(1))
    with pytest.raises(RuntimeError, match=r"pip failed \(1\):\n(?s:.*)line 39\nERROR: No matching distribution") as e:
        exec(_install_cell(path), {})
    assert "line 20" not in str(e.value)  # its tail only
    assert f"git+https://github.com/{GITHUB_REPO}" in calls[-1]
    monkeypatch.setattr(subprocess, "run", pip(0))
    exec(_install_cell(path), {})
    monkeypatch.setenv("QWEN35_REPO", "someone/fork")
    exec(_install_cell(path), {})
    assert "git+https://github.com/someone/fork'" in calls[-1] and len(calls) == 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_every_exercise_has_a_folded_answer_and_one_the_run_computes(path: pathlib.Path) -> None:
    """Each exercise (`N. **[Title]**` under `## Exercises`) has its answer folded in `<details>`, and the run computes
    its numbers (`notebook.answer(N, ...)`: folded too, in the rendered notebook and on Colab)."""
    text = path.read_text()
    assert "# ## Exercises" in text, f"{path.name} has no exercises"
    exercises = text.split("# ## Exercises", 1)[1]
    items = re.split(r"^# (\d+)\. \*\*\[", exercises, flags=re.M)
    numbers = items[1::2]
    assert numbers == [str(i) for i in range(1, len(numbers) + 1)], numbers
    unfolded = [n for n, body in zip(numbers, items[2::2]) if "<details><summary>Answer</summary>" not in body]
    assert not unfolded, f"{path.name}: exercises without a folded answer: {unfolded}"
    computed = set(re.findall(r"notebook\.answer\((\d+),", text))
    assert set(numbers) <= computed, f"{path.name}: exercises whose numbers the run does not compute: " \
                                     f"{sorted(set(numbers) - computed, key=int)}"
