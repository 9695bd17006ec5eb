"""`python -m qwen35_lib.kernels.native`: builds every native kernel (`build.main`) with its arguments, and runs with
no runpy warning (`-m ...native.build` warned: importing `qwen35_lib` loads `build` before runpy executes it)."""

import runpy
import sys
import warnings

import pytest

from qwen35_lib.kernels.native import build


def test_the_package_runs_build_main_with_no_warning(monkeypatch):
    calls = []
    monkeypatch.setattr(build, "main", lambda argv=None: calls.append(sys.argv[1:]) or 1)
    monkeypatch.setattr(sys, "argv", ["qwen35_lib.kernels.native", "--isa", "avx2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(SystemExit) as exit_:
            runpy.run_module("qwen35_lib.kernels.native", run_name="__main__")
    assert exit_.value.code == 1 and calls == [["--isa", "avx2"]]  # main's status is the exit status
