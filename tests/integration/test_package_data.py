"""The data files the library reads ship inside the package: a wheel built from the sources holds every one,
and the library installed from it (not the checkout) reads them."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

from qwen35_lib import data

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "qwen35_lib" / "data"
PACKAGE_DATA = sorted(p.relative_to(DATA).as_posix() for p in DATA.rglob("*.json"))  # aot/port/ too


def test_the_repository_data_folder_is_the_package_one():
    assert (ROOT / "data").resolve() == (ROOT / "qwen35_lib" / "data").resolve()
    assert {"hardware.json", "workloads.json", "published.json", "recipes.json"} <= set(PACKAGE_DATA)
    assert all(data.path(n) == DATA / n for n in PACKAGE_DATA)


def test_the_data_folder_override_replaces_only_the_files_it_holds(tmp_path, monkeypatch):
    (tmp_path / "hardware.json").write_text("{}")
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    assert data.path("hardware.json") == tmp_path / "hardware.json"
    assert data.path("workloads.json") == ROOT / "qwen35_lib" / "data" / "workloads.json"


def test_a_wheel_holds_the_data_and_the_installed_library_reads_it(tmp_path):
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "qwen35_lib", src / "qwen35_lib", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("qwen35_playbook-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"qwen35_lib/data/{n}" for n in PACKAGE_DATA} <= names

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    probe = ("import qwen35_lib, qwen35_lib.hardware as hw, qwen35_lib.bench.workloads as wl, qwen35_lib.recipe as r;"
             "from qwen35_lib.costmodel import specs, validate;"
             "print(qwen35_lib.__file__); hw.get('tpu7x-8'); wl.load(); r.recipes(); specs.get('tpu7x-8');"
             "validate.published()")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert pathlib.Path(out.stdout.splitlines()[0]).is_relative_to(site)  # the installed copy, not the checkout
