"""A fake checkout (one 2-cell notebook, three chapters quoting its results) for the playbook tests."""

from __future__ import annotations

import pathlib

import jupytext
import nbformat
import pytest

from playbook import explorer, run, site

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="  # 1 x 1


NOTEBOOK_CELLS = [
    nbformat.v4.new_markdown_cell("# 00 · Demo: does the builder work?"),
    nbformat.v4.new_code_cell(
        "import json, os, pathlib\n"
        "if os.environ.get('QWEN35_RESULTS_DIR'):\n"
        "    pathlib.Path(os.environ['QWEN35_RESULTS_DIR'], 'demo.json').write_text("
        "json.dumps({'answer': 42, 'sizes': [1024, 3 * 2**30]}))\n"
        "print('hello from the demo')"),
    nbformat.v4.new_code_cell(
        "# figure: dot\n"
        "import base64\nfrom IPython.display import Image, display\n"
        f"display(Image(data=base64.b64decode({PNG!r})))"),
]


@pytest.fixture
def checkout(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A checkout with one fake notebook and three chapters quoting its results."""
    notebooks, chapters = tmp_path / "notebooks", tmp_path / "chapters"
    notebooks.mkdir()
    chapters.mkdir()
    jupytext.write(nbformat.v4.new_notebook(cells=NOTEBOOK_CELLS), notebooks / "00_demo.py", fmt="py:percent")
    chapters.joinpath("introduction.md").write_text("# Intro\n\nSee {{ source: qwen35_lib }}.\n")
    chapters.joinpath("00_demo.md").write_text("# 0 · Demo\n\nThe answer is {{ result: 00.demo.answer }}.\n\n"
                                               "{{ figure: 00.dot }}\n")
    chapters.joinpath("conclusion.md").write_text(
        "# The end\n\n| what | value |\n|---|---|\n| size | {{ result: 00.demo.sizes.1 | bytes }} |\n"
        "| later | {{ result: 01.ladder.gain | x }} |\n")
    chapters.joinpath("01_later.md").write_text("# 1 · Later\n\nNo notebook yet.\n")
    monkeypatch.setattr(run, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(site, "CHAPTERS", chapters)
    # the site's explorer page over one point of each grid: its grids are test_explorer's, and `make playbook`
    # builds the whole page (the whole grid took 17 s of every site test in CI)
    monkeypatch.setattr(explorer, "SHARDING", dict(explorer.SHARDING, hardware=("tpu7x-8",), layouts=("dp_ep",),
                                                   contexts=(explorer.WHOLE_CONTEXT,), requests=(512,)))
    monkeypatch.setattr(explorer, "LADDER", dict(explorer.LADDER, workloads=((1024, 1024),), concurrencies=(16,)))
    return tmp_path
