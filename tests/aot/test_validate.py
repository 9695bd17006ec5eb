"""The isolated AOT validation's reporting: the child's last JSON line, or an error that says what happened (a
crash by signal, the child's last stderr line, a timeout), on a stubbed child process (the compile itself needs
libtpu: tests/integration/test_tpu_compile.py)."""

from __future__ import annotations

import json
import subprocess
import types

import pytest

from qwen35_lib.aot import validate


@pytest.fixture
def child(monkeypatch):
    seen = {}

    def use(returncode=0, stdout="", stderr="", timeout=False):
        def run(cmd, capture_output, text, timeout, env):
            seen.update(cmd=cmd, env=env, timeout=timeout)
            if timeout_flag:
                raise subprocess.TimeoutExpired(cmd, timeout)
            return types.SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr)

        timeout_flag = timeout
        monkeypatch.setattr(subprocess, "run", run)
        return seen

    return use


def test_the_childs_last_json_line_is_the_result(child):
    seen = child(stdout='libtpu says hello\n{"model": "old"}\n{"model": "qwen3.5-tiny", "flops_ratio": 1.02}\n')
    assert validate.aot_forward_isolated("qwen3.5-tiny", 2, 1, 8) == {"model": "qwen3.5-tiny", "flops_ratio": 1.02}
    code = seen["cmd"][-1]
    assert "get_config('qwen3.5-tiny', num_layers=2)" in code and "aot_forward(" in code and ", 1, 8)" in code
    assert seen["env"]["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1" and seen["timeout"] == 600


@pytest.mark.parametrize("run, error", [
    (dict(returncode=-11), "the compiler crashed (signal 11)"),
    (dict(returncode=1, stderr="Traceback\n  ...\nRuntimeError: cannot describe TPU topology\n"),
     "RuntimeError: cannot describe TPU topology"),
    (dict(returncode=1), "no output"),
    (dict(returncode=0, stdout="no json here\n"), "no output"),
    (dict(timeout=True), "compile took over 600 s"),
])
def test_a_failed_child_is_an_error_entry(child, run, error):
    child(**run)
    got = validate.aot_forward_isolated("qwen3.5-mini", 4, 2, 64)
    assert got == dict(model="qwen3.5-mini", layers=4, batch=2, seq=64, error=error)
    json.dumps(got)  # goes into the benchmark's JSON as it is
