"""`pytest` runs every paired notebook (`notebooks/NN_*.ipynb`, in testpaths; `--nbmake` in addopts), each once in
a fresh `python3` kernel. The kernel inherits this environment, set around each notebook item only: the checkout
importable, 8 simulated CPU devices with patient collectives, XLA:CPU compiling fast (FAST_COMPILE), matplotlib inline,
nothing recorded, libtpu shareable. The longest items run first (`pytest_collection_modifyitems`)."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent
DEVICES = "--xla_force_host_platform_device_count=8"
# XLA:CPU compiles fast in the tests and the notebook kernels they run (FAST_COMPILE; tests/conftest.py sets it in
# $XLA_FLAGS before jax is imported): a test's time is mostly compiles of tiny models. LLVM at -O0 makes them about a
# third shorter; the legacy (pre-MLIR) fusion emitters about 40% shorter again (measured on one engine run of
# qwen3.5-tiny: 31.7 s -> 20.3 s cold, and a 2-group qwen3.5-mini step: 10.6 s -> 5.9 s; greedy tokens identical).
# No YNNPACK fusions (an empty fusion-type list): dots run as XLA's own, and no YNNPACK executable is built per
# fusion (its slinky pipeline simplification was 9% of a perf profile of tests/plan/test_mesh.py); pinned pairs of
# test_mesh with test_engine, 105.4 / 106.9 s against 108.3 / 110.0 s.
# One LLVM module a program instead of 32 split parts (XLA:CPU's default, for compiling on a thread pool: each worker
# has one core): the same code, emitted once. Pinned pairs of an engine run under dp8_ep8 and a tp8_kvrep forward
# (qwen3.5-tiny, 8 layers), backend compile 11.2-16.1 s against 13.5-18.4 s, shorter in 7 of 8 pairs (median 0.86x).
# -O0 leaves the optimized HLO as it is; the legacy emitters fuse a little differently. The tiny forward's logits
# agree with the defaults' to float32 rounding (4e-7 at logits of 0.6). What runs is slower than the library's
# default, so no time measured under pytest stands for the library's speed (nothing is recorded). A flag set in
# $XLA_FLAGS wins; TPU compiles (aot_subprocess.py) get the defaults. The chapters' timings (06's CPU validation)
# then measure slower code than a reader's run: nothing is recorded here ($QWEN35_RESULTS_DIR is unset), and
# `make playbook` executes the chapters at the defaults.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_parallel_codegen_split_count=1")
SAVED = pytest.StashKey[pytest.MonkeyPatch]()
# Modules whose one module fixture compiles for TPU7x for 130-190 s. xdist's worksteal deals each worker a
# contiguous share and steals from the end of a queue: at the end of the list such a module finished the run alone
# on one worker, or was split over both and its fixture compiled twice.
# test_collective_hlo's items compile a mini step each (10-70 s): at the end they were the run's tail on both workers.
FIRST = ("tests/integration/test_tpu_in_place.py", "tests/integration/test_tpu_overlap.py",
         "tests/integration/test_collective_hlo.py")


def _own_cores() -> None:
    """Under pytest-xdist, each worker on its own share of the cores (of 2 cores and 2 workers: one each), and so
    every process it starts (notebook kernels, CLI and TPU7x-compile children). XLA's and libtpu's thread pools
    otherwise spread each process over every core, in each worker at once."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    if not worker or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if not 1 < count <= len(cpus):
        return
    mine = set(cpus[int(worker.removeprefix("gw"))::count])
    for tid in os.listdir("/proc/self/task"):  # threads started so far; later ones inherit it
        os.sched_setaffinity(int(tid), mine)


_own_cores()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of FIRST, then everything in collection order (the notebooks next: testpaths)."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in FIRST)  # stable: the rest keep their order


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.path.suffix != ".ipynb":
        return
    from playbook import RESULTS_ENV  # not at import: tests/conftest.py sets jax up first
    from qwen35_lib.devices import with_patient_collectives

    env = item.stash[SAVED] = pytest.MonkeyPatch()
    env.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    flags = os.environ.get("XLA_FLAGS", "")
    flags = flags if DEVICES in flags else f"{flags} {DEVICES}".strip()
    # FAST_COMPILE is in $XLA_FLAGS already when tests/conftest.py ran; a flag already set wins
    flags = " ".join([f for f in FAST_COMPILE if f.split("=")[0] + "=" not in flags] + [flags]).strip()
    env.setenv("XLA_FLAGS", with_patient_collectives(flags))
    env.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    env.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # kernels compiling for TPU7x ahead of time share libtpu
    env.delenv(RESULTS_ENV, raising=False)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    if SAVED in item.stash:
        item.stash[SAVED].undo()
