"""Ahead-of-time TPU7x compiles in a fresh interpreter, so that libtpu never enters a pytest process.

libtpu carries its own copy of XLA and LLVM; a pytest worker that had loaded it (`aot.topology_devices()`) and
then compiled for XLA:CPU segfaulted now and then (issue 16). Tests marked `tpu_compile` therefore compile in a
child process and assert on what it sends back:

    def _temp_bytes(rows):  # module level: the child imports this test module and calls it
        return jax.jit(f).lower(S((rows, D), jnp.bfloat16)).compile().memory_analysis().temp_size_in_bytes

    @pytest.fixture(scope="module")
    def tpu7x():
        return aot_subprocess.run({f"rows {r}": (_temp_bytes, r) for r in (640, 10240)})  # one child for all

    def test_x(tpu7x):
        assert tpu7x["rows 640"] < 2**20  # a job that raised in the child raises its traceback here
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any, Callable

import pytest

MARK = "AOT-RESULTS "
CHILD = f"""
import importlib, json, sys, traceback
spec = json.load(sys.stdin)
sys.path[:0] = spec["path"]
out = {{}}
for name, module, qualname, args in spec["jobs"]:
    try:
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        out[name] = {{"ok": fn(*args)}}
    except Exception:
        out[name] = {{"error": traceback.format_exc()}}
print({MARK!r} + json.dumps(out), flush=True)
"""


class ChildError(AssertionError):
    """A job that raised in the child process; the message is its traceback."""


class Results(dict):
    """{job name: its return value}; a job that raised in the child raises `ChildError` when read."""

    def __getitem__(self, name: str) -> Any:
        r = super().__getitem__(name)
        if "error" in r:
            raise ChildError(f"job {name!r} raised in the ahead-of-time compile process:\n{r['error']}")
        return r["ok"]


def require_libtpu() -> None:
    """Skip the calling test when libtpu is not installed; in CI (CI=true) fail instead: it must be there."""
    if importlib.util.find_spec("libtpu") is None:
        why = "libtpu is not installed: pip install 'qwen35-playbook[tpu]' for the ahead-of-time TPU7x compiles"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


def run(jobs: dict[str, tuple], timeout: float = 540) -> Results:
    """{name: (fn, *args)} -> {name: fn(*args)}, every job in one fresh interpreter (JAX_PLATFORMS=cpu, libtpu
    loaded there only). fn: a module-level function of an importable module (a test module too) returning
    JSON-able values; args JSON-able."""
    require_libtpu()
    spec = {"path": sys.path, "jobs": [[name, _module(fn), fn.__qualname__, list(args)] for name, (fn, *args) in
                                       jobs.items()]}
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # TPU executables stay out of the workers' CPU caches
    # the TPU compiler at its defaults: FAST_COMPILE and the other --xla_cpu_ flags are for XLA:CPU's compiles
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith(("--xla_backend_optimization_level=", "--xla_cpu_")))
    try:
        p = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(spec), capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the ahead-of-time compiles {list(jobs)} took over {timeout} s") from e
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        how = f"died by signal {-p.returncode}" if p.returncode < 0 else f"exited with {p.returncode}"
        raise AssertionError(f"the ahead-of-time compile process {how} running {list(jobs)}; its stderr ends:\n"
                             + "\n".join(p.stderr.splitlines()[-30:]))
    return Results(json.loads(lines[-1][len(MARK):]))


def _module(fn: Callable) -> str:
    if "<locals>" in fn.__qualname__ or fn.__module__ == "__main__":
        raise ValueError(f"{fn.__qualname__} must be a module-level function of an importable module to run "
                         "in the child process")
    return fn.__module__
