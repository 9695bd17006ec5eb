"""The notebook runner's helpers (the whole build, kernel and HTML included, is tests/playbook/test_build.py's):
which notebooks it finds, the kernel's environment, the title and figures it reads from a notebook, its progress
lines."""

from __future__ import annotations

import base64
import os

import nbformat
import pytest

from playbook import RESULTS_ENV, run
from tests.playbook.conftest import PNG


def test_notebook_paths_in_order_and_an_unknown_name_refused(tmp_path, monkeypatch):
    for name in ("02_b.py", "00_a.py", "10_c.py", "helper.py", "01_notes.md"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(run, "NOTEBOOKS", tmp_path)
    assert [p.name for p in run.notebook_paths()] == ["00_a.py", "02_b.py", "10_c.py"]
    assert [p.stem for p in run.notebook_paths(["10_c", "00_a"])] == ["00_a", "10_c"]
    with pytest.raises(SystemExit, match=r"unknown notebooks \['99_z'\]; known: \['00_a', '02_b', '10_c'\]"):
        run.notebook_paths(["99_z", "00_a"])


def test_kernel_env_puts_the_checkout_first_and_frees_jax_on_an_accelerator(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(run, "accelerator_present", lambda: False)
    env = run.kernel_env(tmp_path)
    assert env["PYTHONPATH"] == os.pathsep.join([str(run.ROOT), "/elsewhere"])
    assert env[RESULTS_ENV] == str(tmp_path) and env["JAX_PLATFORMS"] == "cpu"
    assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
    monkeypatch.setattr(run, "accelerator_present", lambda: True)
    assert "JAX_PLATFORMS" not in run.kernel_env(tmp_path)  # the Makefile's CPU default would hide the TPU
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert run.kernel_env(tmp_path)["JAX_PLATFORMS"] == "tpu"  # one set on purpose stays


def test_accelerator_present_reads_device_files(monkeypatch):
    seen = []
    monkeypatch.setattr(run.glob, "glob", lambda pattern: seen.append(pattern) or (["/dev/accel0"] if "accel" in
                                                                                   pattern else []))
    assert run.accelerator_present() and seen == ["/dev/accel*"]
    monkeypatch.setattr(run.glob, "glob", lambda pattern: [])
    assert not run.accelerator_present()


def test_title_is_the_first_markdown_h1():
    cells = [nbformat.v4.new_code_cell("# 00 · not a heading: code"), nbformat.v4.new_markdown_cell("## Sub\ntext"),
             nbformat.v4.new_markdown_cell("intro\n# 03 · The title \n# later")]
    assert run.title_of(nbformat.v4.new_notebook(cells=cells)) == "03 · The title"
    assert run.title_of(nbformat.v4.new_notebook(cells=cells[:2])) == ""


def test_each_marked_cell_gives_its_first_png(tmp_path):
    png = {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG, "text/plain": "<Image>"}}
    other = {"output_type": "display_data", "metadata": {}, "data": {"image/png": base64.b64encode(b"x").decode()}}
    cells = [nbformat.v4.new_code_cell("# figure: dot\nshow()"), nbformat.v4.new_code_cell("# figure: empty\n1"),
             nbformat.v4.new_code_cell("show()"), nbformat.v4.new_markdown_cell("# figure: prose")]
    cells[0].outputs = [nbformat.v4.new_output("stream", text="hi"), nbformat.from_dict(png),
                        nbformat.from_dict(other)]
    cells[2].outputs = [nbformat.from_dict(png)]  # unmarked: not a figure
    got = run.save_figures(nbformat.v4.new_notebook(cells=cells), tmp_path, "04_demo")
    assert got == {"dot": "figures/04_demo-dot.png"}
    assert (tmp_path / got["dot"]).read_bytes() == base64.b64decode(PNG)
    assert [p.name for p in (tmp_path / "figures").iterdir()] == ["04_demo-dot.png"]


def test_progress_lines(capsys):
    p = run.Progress(2, live=False)
    p.start(1, "00_a", 5)
    p.cell(1, "00_a", 3, 5, 1.0)  # not live: no per-cell output
    p.end(1, dict(name="00_a", cells=5, seconds=1.34, status="ok", error=None))
    p.end(2, dict(name="01_b", cells=2, seconds=0.5, status="failed", error="ValueError: boom"))
    assert capsys.readouterr().err.splitlines() == [
        "[1/2] 00_a: started, 5 code cells", "[1/2] 00_a: 5 cells, 1.3 s, ok",
        "[2/2] 01_b: 2 cells, 0.5 s, FAILED: ValueError: boom"]
    live = run.Progress(1, live=True)  # a tqdm bar of the cells, then the notebook's line
    live.start(1, "00_a", 4)
    live.cell(1, "00_a", 2, 4, 3.0)
    assert live.bars[1].n == 2
    live.end(1, dict(name="00_a", cells=4, seconds=3.0, status="ok", error=None))
    err = capsys.readouterr().err
    assert "[1/1] 00_a" in err and "0/4" in err and err.splitlines()[-1].endswith("[1/1] 00_a: 4 cells, 3.0 s, ok")
    assert live.bars == {}


def test_a_traceback_a_cell_printed_is_an_error_naming_the_cell():
    ok = nbformat.v4.new_code_cell("print('fine')")
    ok.outputs = [nbformat.v4.new_output("stream", text="fine\nValueError is a word here\n")]
    shown = nbformat.v4.new_code_cell("fig\n")  # an error IPython showed without raising (a formatter's)
    shown.outputs = [nbformat.v4.new_output("error", ename="NameError", evalue="name 'np' is not defined",
                                            traceback=["..."])]
    printed = nbformat.v4.new_code_cell("\nrun_in_thread()")
    printed.outputs = [nbformat.v4.new_output("stream", name="stderr", text=(
        "Exception in thread Thread-1:\n\x1b[0;31mTraceback (most recent call last):\n  File \"x.py\", line 1\n"
        "    np.zeros(3)\nNameError: name 'np' is not defined\n"))]
    cells = [nbformat.v4.new_markdown_cell("# T"), ok, shown, nbformat.v4.new_markdown_cell("x"), printed]
    assert run.printed_errors(nbformat.v4.new_notebook(cells=cells)) == [
        "code cell 2 ('fig') printed a traceback: NameError: name 'np' is not defined",
        "code cell 3 ('run_in_thread()') printed a traceback: NameError: name 'np' is not defined"]
    assert run.printed_errors(nbformat.v4.new_notebook(cells=cells[:2])) == []


@pytest.mark.parametrize("cell", [
    "import traceback\ntry:\n    np.zeros(3)\nexcept NameError:\n    traceback.print_exc()",
    "import threading\nt = threading.Thread(target=lambda: np.zeros(3))\nt.start()\nt.join()",  # its hook prints it
    # a post-execute callback (as the inline backend's figure drawing is): IPython prints its traceback, goes on
    "get_ipython().events.register('post_execute', lambda: np.zeros(3))",
])
def test_a_notebook_whose_cell_printed_a_traceback_fails(tmp_path, cell):
    import jupytext

    cells = [nbformat.v4.new_markdown_cell("# 00 · Printed"), nbformat.v4.new_code_cell("x = 1"),
             nbformat.v4.new_code_cell(cell), nbformat.v4.new_code_cell("print('after')")]
    path = tmp_path / "00_printed.py"
    jupytext.write(nbformat.v4.new_notebook(cells=cells), path, fmt="py:percent")
    entry = run.execute(path, tmp_path / "out", 120, run.Progress(1, live=False), 1)
    first = cell.splitlines()[0][:60]  # the label quotes a first line up to 60 characters
    assert entry["status"] == "failed", entry
    assert entry["error"] == f"code cell 2 ({first!r}) printed a traceback: NameError: name 'np' is not defined"


def test_a_cell_that_raised_is_named(tmp_path):
    import jupytext

    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("\nnp.zeros(3)"),
             nbformat.v4.new_code_cell("print('never')")]
    path = tmp_path / "00_raised.py"
    jupytext.write(nbformat.v4.new_notebook(cells=cells), path, fmt="py:percent")
    entry = run.execute(path, tmp_path / "out", 120, run.Progress(1, live=False), 1)
    assert entry["status"] == "failed" and entry["error"] == (
        "CellExecutionError: NameError: name 'np' is not defined (in code cell 2 ('np.zeros(3)'))"), entry


def test_each_notebook_records_its_slowest_cells(tmp_path):
    import jupytext

    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("import time\ntime.sleep(0.5)"),
             nbformat.v4.new_code_cell("y = 2"), nbformat.v4.new_code_cell("z = 3")]
    path = tmp_path / "00_slow.py"
    jupytext.write(nbformat.v4.new_notebook(cells=cells), path, fmt="py:percent")
    entry = run.execute(path, tmp_path / "out", 120, run.Progress(1, live=False), 1)
    slowest = entry["slowest_cells"]
    assert entry["status"] == "ok" and len(slowest) == 3, entry
    assert slowest == sorted(slowest, key=lambda c: -c["seconds"]) and {c["cell"] for c in slowest} <= {1, 2, 3, 4}
    cell2 = next(c["seconds"] for c in slowest if c["cell"] == 2)
    assert cell2 >= 0.5 and sum(c["seconds"] for c in slowest) <= entry["seconds"], entry
