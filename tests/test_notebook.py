"""The two calls every notebook makes, `notebook.setup()` and `notebook.save_results(...)`, and what precedes them: at
most 10 lines before a chapter's first section (one install line, one `setup` call)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jupytext
import pytest

from qwen35_lib import notebook


def test_setup_gives_the_simulated_devices_and_the_size(monkeypatch, capsys):
    monkeypatch.setattr(notebook, "has_accelerator", lambda: False)
    monkeypatch.delenv(notebook.SIZE_ENV, raising=False)
    devices, size, mesh = notebook.setup()
    assert devices == jax.devices() and len(devices) == 8 and size == "cpu"
    assert dict(mesh.shape) == {"chip": 4, "core": 2} and sorted(d.id for d in mesh.devices.flat) == [
        d.id for d in devices]
    assert capsys.readouterr().out.startswith("8 x ")
    monkeypatch.setenv(notebook.SIZE_ENV, "tpu")
    assert notebook.setup()[1] == "tpu"
    monkeypatch.setenv(notebook.SIZE_ENV, "huge")
    with pytest.raises(ValueError, match=r"\$QWEN35_SIZE='huge': use one of cpu, tpu"):
        notebook.setup()


def test_setup_refuses_a_backend_started_with_another_device_count(monkeypatch):
    monkeypatch.setattr(notebook, "has_accelerator", lambda: False)
    with pytest.raises(RuntimeError, match="JAX started with 8 CPU devices, not 4: restart the kernel"):
        notebook.setup(cpu_devices=4)


def test_results_are_written_only_for_the_builder(tmp_path, monkeypatch):
    monkeypatch.delenv(notebook.RESULTS_ENV, raising=False)
    assert notebook.save_results("demo", {"x": 1}) is None
    monkeypatch.setenv(notebook.RESULTS_ENV, str(tmp_path))
    path = notebook.save_results("demo", {"x": 1})
    assert path == tmp_path / "demo.json" and json.loads(path.read_text()) == {"x": 1}


def test_setup_runs_a_one_device_accelerator_runtime_on_simulated_cpu_devices(monkeypatch, capsys):
    """A Colab TPU v5e-1 / GPU runtime has 1 device: a layout chapter runs on 8 simulated CPU devices, said so."""
    platforms = []
    monkeypatch.setattr(notebook, "probe_accelerator", lambda: ("tpu", 1, "TPU v5 lite"))
    monkeypatch.setattr(jax.config, "update", lambda name, value: platforms.append((name, value)))
    monkeypatch.delenv(notebook.SIZE_ENV, raising=False)
    devices, size, _ = notebook.setup()
    assert ("jax_platforms", "cpu") in platforms and size == "cpu" and len(devices) == 8
    out = capsys.readouterr().out
    assert "1 accelerator device(s), fewer than the 8" in out and notebook.runtime().description in out
    assert (notebook.runtime().twins, notebook.runtime().pallas) == ("cpu", "interpret")


def test_the_kernel_chapter_keeps_the_one_device_accelerator_beside_the_simulated_devices(monkeypatch, capsys):
    """`prefer_accelerator`: the TPU is JAX's default backend (the kernels run on it), the 8 CPU devices beside it."""
    platforms = []
    monkeypatch.setattr(notebook, "probe_accelerator", lambda: ("tpu", 1, "TPU v5 lite"))
    monkeypatch.setattr(jax.config, "update", lambda name, value: platforms.append((name, value)))
    monkeypatch.delenv(notebook.SIZE_ENV, raising=False)
    devices, size, mesh = notebook.setup(prefer_accelerator=True)
    assert ("jax_platforms", "tpu,cpu") in platforms and size == "cpu"
    assert devices == jax.devices("cpu") and len(devices) == 8  # the layouts' devices, as setup() always returns
    assert mesh.devices.flat[0].platform == "cpu"  # the mesh is theirs, not the accelerator's
    rt = notebook.runtime()
    assert (rt.layouts, rt.twins, rt.pallas) == ("cpu", "tpu", "compiled")
    assert capsys.readouterr().out.splitlines()[-1] == rt.description


def test_the_accelerator_count_is_probed_only_where_there_is_one(monkeypatch):
    monkeypatch.setattr(notebook, "has_accelerator", lambda: False)
    assert notebook.accelerator_device_count() == 0
    assert notebook.probe_accelerator() == ("none", 0, "")


@pytest.mark.parametrize(("stdout", "returncode", "found", "said"), [
    ('["tpu", 1, "TPU v5 lite"]\n', 0, ("tpu", 1, "TPU v5 lite"), ""),
    ('some log line\n["gpu", 8, "NVIDIA H200"]\n', 0, ("gpu", 8, "NVIDIA H200"), ""),
    ('["cpu", 1, "cpu"]\n', 0, ("none", 0, ""), "JAX starts cpu"),  # no plugin, or JAX_PLATFORMS=cpu
    ("", 1, ("none", 0, ""), "the accelerator did not start JAX (RuntimeError: no TPU)"),
])
def test_the_probe_reads_the_platform_count_and_kind(monkeypatch, capsys, stdout, returncode, found, said):
    import subprocess

    monkeypatch.setattr(notebook, "has_accelerator", lambda: True)
    done = subprocess.CompletedProcess([], returncode, stdout=stdout, stderr="RuntimeError: no TPU\n")
    monkeypatch.setattr(notebook.subprocess, "run", lambda *a, **k: done)
    assert notebook.probe_accelerator() == found
    assert said in capsys.readouterr().out


# (accelerator, devices, kind) -> (layouts, layout devices, twins, pallas, size, jax_platforms: layout chapter,
# kernel chapter)
RUNTIMES = {
    "no accelerator": (("none", 0, ""), ("cpu", 8, "cpu", "interpret", "cpu", None, None)),
    "TPU v5e-1": (("tpu", 1, "TPU v5 lite"), ("cpu", 8, "tpu", "compiled", "cpu", "cpu", "tpu,cpu")),
    "TPU7x-8": (("tpu", 8, "TPU7x"), ("tpu", 8, "tpu", "compiled", "tpu", None, None)),
    "GPU x 1": (("gpu", 1, "NVIDIA L4"), ("cpu", 8, "gpu", "interpret", "cpu", "cpu", "cuda,cpu")),
    "GPU x 8": (("gpu", 8, "NVIDIA H200"), ("gpu", 8, "gpu", "interpret", "cpu", None, None)),
}


@pytest.mark.parametrize("name", RUNTIMES)
def test_select_runtime(name):
    found, (layouts, count, twins, pallas, size, layout_platforms, kernel_platforms) = RUNTIMES[name]
    kernel = notebook.select_runtime(*found, prefer_accelerator=True)  # the kernel chapter (05)
    assert (kernel.layouts, kernel.layout_devices, kernel.twins, kernel.pallas, kernel.size) == \
        (layouts, count, twins, pallas, size)
    assert kernel.jax_platforms == kernel_platforms and kernel.simulated == (layouts == "cpu")
    layout = notebook.select_runtime(*found)  # every other chapter: JAX's default backend holds the layouts
    assert (layout.layouts, layout.layout_devices, layout.size, layout.jax_platforms) == \
        (layouts, count, size, layout_platforms)
    assert (layout.twins, layout.pallas) == ((twins, pallas) if not layout.simulated or found[0] == "none"
                                             else ("cpu", "interpret"))
    for rt in (kernel, layout):
        assert "\n" not in rt.description and rt.kernels in rt.description and "tpu7x:2x2x1" in rt.description
        assert rt.description.startswith(f"{found[2]} x {found[1]}: " if found[1] else "no accelerator: ")
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernel.twins = "cpu"


def test_select_runtime_says_what_runs_where():
    one_tpu = notebook.select_runtime("tpu", 1, "TPU v5 lite", prefer_accelerator=True).description
    assert "layouts on 8 simulated CPU devices (fewer than 8 TPU devices)" in one_tpu
    assert "XLA twins and Pallas kernels (compiled by Mosaic) on the TPU" in one_tpu
    one_gpu = notebook.select_runtime("gpu", 1, "NVIDIA L4", prefer_accelerator=True).description
    assert "XLA twins on the GPU, Pallas TPU kernels in interpret mode beside them" in one_gpu
    assert "the TPU itself serves the kernel chapter (05)" in notebook.select_runtime("tpu", 1).description
    assert "layouts on the 8 TPU devices" in notebook.select_runtime("tpu", 8, "TPU7x").description


@pytest.mark.parametrize(("args", "message"), [
    (("npu", 1), "use one of none, tpu, gpu"), (("none", 2), "no accelerator but 2"), (("tpu", 0), "with 0 devices")])
def test_select_runtime_refuses_what_is_not_a_runtime(args, message):
    with pytest.raises(ValueError, match=message):
        notebook.select_runtime(*args)


def test_runtime_before_setup_says_to_call_it():
    code = "from qwen35_lib import notebook\ntry:\n    notebook.runtime()\nexcept RuntimeError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "notebook.setup() has not run yet" in out.stdout, out.stderr


FRESH_SETUP = """
from qwen35_lib import notebook
devices, size, mesh = notebook.setup()
import jax
rt = notebook.runtime()
assert devices == jax.devices() and len(devices) == 8 and devices[0].platform == "cpu", devices
assert (size, rt.accelerator, rt.layouts, rt.twins, rt.pallas) == ("cpu", "none", "cpu", "cpu", "interpret"), rt
print("ok")
"""


def test_setup_on_this_cpu_machine_starts_8_cpu_devices_in_a_fresh_process():
    """A notebook's own start (no conftest): setup() alone gives the 8 simulated CPU devices."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    env.pop(notebook.SIZE_ENV, None)
    done = subprocess.run([sys.executable, "-c", FRESH_SETUP], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1] == "ok", done.stderr[-2000:]


def _installed(monkeypatch, versions: dict, jax_requires: list[str]) -> None:
    monkeypatch.setattr(notebook, "installed_version", versions.get)
    monkeypatch.setattr(notebook.importlib.metadata, "requires", lambda name: jax_requires)


JAX_REQUIRES = ['libtpu==0.0.42.*; extra == "tpu"', 'jax-cuda12-plugin[with-cuda]<=0.10.2,>=0.10.2; extra == "cuda12"']


@pytest.mark.parametrize(("accelerator", "prefer", "versions", "wanted"), [
    ("none", False, {"jax": "0.10.2"}, None),
    ("tpu", False, {"jax": "0.10.2", "libtpu": "0.0.42.1"}, None),  # the pinned libtpu is there
    ("tpu", False, {"jax": "0.10.2"}, "jax[tpu]==0.10.2"),  # none
    ("tpu", False, {"jax": "0.10.2", "libtpu": "0.0.21"}, "jax[tpu]==0.10.2"),  # Colab's own, for its own jax
    ("gpu", False, {"jax": "0.10.2"}, None),  # a layout chapter leaves the GPU as it is
    ("gpu", True, {"jax": "0.10.2", "libtpu": "0.0.42.1", "jax-cuda12-plugin": "0.10.2"}, None),
    ("gpu", True, {"jax": "0.10.2", "libtpu": "0.0.42.1", "jax-cuda12-plugin": "0.7.1"}, "jax[tpu,cuda12]==0.10.2"),
])
def test_the_jax_plugin_an_accelerator_lacks(monkeypatch, accelerator, prefer, versions, wanted):
    _installed(monkeypatch, versions, JAX_REQUIRES)
    assert notebook.jax_plugin_requirement(accelerator, prefer_accelerator=prefer) == wanted


def test_the_plugin_is_installed_only_into_a_library_installed_from_git(monkeypatch, capsys):
    """The install line's own install (Colab): pip brings libtpu on a TPU runtime; a checkout or a `make` venv never."""
    calls = []
    _installed(monkeypatch, {"jax": "0.10.2"}, JAX_REQUIRES)
    monkeypatch.setattr(notebook, "has_accelerator", lambda: True)
    monkeypatch.setattr(notebook.glob, "glob", lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    monkeypatch.setattr(notebook.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setattr(notebook, "installed_from_git", lambda: False)
    assert notebook.install_jax_plugin() is None and calls == []
    monkeypatch.setattr(notebook, "installed_from_git", lambda: True)
    assert notebook.install_jax_plugin() == "jax[tpu]==0.10.2"
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", "jax[tpu]==0.10.2"]]
    assert "pip install jax[tpu]==0.10.2" in capsys.readouterr().out


@pytest.mark.parametrize(("record", "from_git"), [
    ('{"url": "https://github.com/o/r", "vcs_info": {"vcs": "git", "commit_id": "abc"}}', True),
    ('{"url": "file:///work/main", "dir_info": {"editable": true}}', False),  # `make`: an editable checkout
    (None, False), ("not json", False)])
def test_installed_from_git_reads_the_pep_610_record(monkeypatch, record, from_git):
    class Dist:
        def read_text(self, name):
            assert name == "direct_url.json"
            return record

    monkeypatch.setattr(notebook.importlib.metadata, "distribution", lambda name: Dist())
    assert notebook.installed_from_git() is from_git


def test_this_checkout_is_not_installed_from_git():
    assert not notebook.installed_from_git()


ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
SETUP_LINES = 10


def setup_lines(path: pathlib.Path) -> list[str]:
    """The non-blank lines of the code cells before the chapter's first `## ` section (comments count)."""
    lines = []
    for cell in jupytext.read(path).cells:
        if cell.cell_type == "markdown" and any(line.startswith("## ") for line in cell.source.splitlines()):
            return lines
        if cell.cell_type == "code":
            lines += [line for line in cell.source.splitlines() if line.strip()]
    raise AssertionError(f"{path.name} has no `## ` section")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_notebook_opens_with_at_most_10_lines_of_setup(path):
    """One install line (Colab), one `notebook.setup(...)` call: the chapter's imports sit where they are used."""
    lines = setup_lines(path)
    assert len(lines) <= SETUP_LINES, f"{path.name}: {len(lines)} lines before its first section:\n" + "\n".join(lines)
    code = "\n".join(lines)
    assert code.count("notebook.setup(") == 1 and code.count("pip install") == 1, code


def test_an_answer_is_shown_folded_with_the_runs_figures(capsys):
    shown = notebook.answer(2, "{n:,} requests, {f:.1%} more", n=1234, f=0.05)
    assert shown == "1,234 requests, 5.0% more"
    out = capsys.readouterr().out  # outside a notebook kernel IPython's display prints the plain text
    assert "Answer to exercise 2, computed by this run: 1,234 requests, 5.0% more" in out


def test_add_totals_sums_every_component_and_refuses_a_missing_one():
    row = dict(total_tokens_per_s=1e6 / 30, previous_total_tokens_per_s=1e6 / 60,
               ms_per_1k_tokens=dict(a=10.0, b=20.0), previous_ms_per_1k_tokens=dict(a=40.0, b=20.0))
    gain = notebook.add_totals(dict(stage="s", w=row), workloads=("w",))
    assert gain["w"]["ms_per_1k_tokens_total"] == 30.0 and gain["w"]["previous_ms_per_1k_tokens_total"] == 60.0
    row["ms_per_1k_tokens"] = dict(a=10.0)  # a component left out: the table would not add up
    with pytest.raises(AssertionError, match="a component is missing"):
        notebook.add_totals(dict(stage="s", w=row), workloads=("w",))
