"""qwen35_lib.versions: the one installed-version helper, and every reader reading it (no second copy)."""

from __future__ import annotations

import pathlib
import re

import jax

from qwen35_lib import versions


def test_installed_version_is_the_distributions_or_none():
    assert versions.installed_version("jax") == jax.__version__
    assert versions.installed_version("no-such-distribution-qwen35") is None


def test_library_version_falls_back_to_unknown(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda name: {versions.DISTRIBUTION: "1.2.3"}.get(name))
    assert versions.library_version() == "1.2.3"
    monkeypatch.setattr(versions, "installed_version", lambda name: None)
    assert versions.library_version() == "0+unknown"


def test_every_reader_reads_the_one_helper(monkeypatch):
    from qwen35_lib import notebook
    from qwen35_lib.aot import sweep
    from qwen35_lib.bench import timing, vs_transformers

    assert notebook.installed_version is timing.installed_version is vs_transformers.installed_version \
        is versions.installed_version
    assert notebook.DISTRIBUTION == versions.DISTRIBUTION
    monkeypatch.setattr(versions, "installed_version", {"libtpu-nightly": "0.0.1"}.get)
    assert sweep._versions() == {"jax": jax.__version__, "libtpu": "0.0.1"}  # libtpu absent: the nightly's


def test_no_other_module_reads_a_version_from_the_metadata_itself():
    root = pathlib.Path(versions.__file__).parent
    readers = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py")) if p.name != "versions.py"
               and re.search(r"\w\.version\(|import version\b", p.read_text())]
    assert readers == [], readers
