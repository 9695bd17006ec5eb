"""Test setup: 8 simulated CPU devices, forced before jax is imported anywhere."""

import os

# Before anything imports jax: it reads JAX_PLATFORMS once, and without "cpu" its first backend also starts the TPU
# plugin, loading libtpu into this process (see _libtpu_stays_out).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from conftest import FAST_COMPILE  # noqa: E402  (the root conftest.py's: the notebook kernels get the same)

_flags = os.environ.get("XLA_FLAGS", "")
_flags = " ".join([_flags] + [f for f in FAST_COMPILE if f.split("=")[0] + "=" not in _flags])
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

from qwen35_lib.devices import patient_collectives  # noqa: E402

patient_collectives()  # a simulated device that lags behind on a busy machine must not abort the test process
# With JAX_COMPILATION_CACHE_DIR set (the Makefile no longer sets it: writing CPU executables into it segfaulted
# now and then), one persistent cache per pytest-xdist worker: two processes writing one entry at once crashed.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] += "-" + os.environ["PYTEST_XDIST_WORKER"]

import jax  # noqa: E402

if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # a plugin may have imported jax (reading the old value) already
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
assert len(jax.devices()) == 8, jax.devices()

import gc  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

from absl import logging as absl_logging  # noqa: E402

# absl's logging handler (jax's) writes to the stream sys.stderr was when it was made, and closes that stream when a
# logging dictConfig clears the handlers (uvicorn's Config does, in `serve.cli.run` and the test servers) unless it
# is the current sys.stderr. Made under pytest's capture, it closed the capture's file under a later test that
# swapped sys.stderr (capsys), and every test after it in the worker errored ("I/O operation on closed file": 2,435
# errors in a clean-clone make test). On sys.__stderr__ it is never closed; fd capture still collects what it writes.
absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__

import pytest  # noqa: E402

# Tracing allocates millions of short-lived Python objects beside a large long-lived heap (compiled programs, jaxprs):
# at Python's default thresholds (700, 10, 10) the collector ran often and walked that heap. Measured with the
# Makefile's jemalloc, pinned pairs of test_engine with test_decoder: 50.8 / 50.9 s against 54.4 / 53.7 s.
gc.set_threshold(20_000, 20, 20)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything alive once the tests are collected (jax, transformers and this package imported, the items) moves to
    the collector's permanent generation: its full collections no longer walk it. Pinned pairs of test_engine,
    test_mesh and test_parallelism: 173.0 / 184.4 / 187.5 s against 190.6 / 201.9 / 194.8 s. (`gc.get_referrers` no
    longer sees frozen referrers: Hypothesis may warn that trio's random generator could be collected.)"""
    gc.freeze()


MAPS = pathlib.Path("/proc/self/maps")  # Linux: one line per memory mapping of this process
MAX_MAP_COUNT = pathlib.Path("/proc/sys/vm/max_map_count")  # Linux: the most mappings a process may hold (65530)


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_leave_mappings():
    """Before each module: when this process holds over half of vm.max_map_count mappings, drop jax's caches of
    compiled programs. XLA:CPU maps code, constants and data (3 mappings) per kernel of every executable jax caches,
    and a test worker compiles thousands of programs: at the limit the next compile's mmap fails and LLVM aborts
    the process ("LLVM ERROR: Unable to allocate section memory!", issue 16). A module re-compiles what it needs."""
    if MAPS.exists() and MAX_MAP_COUNT.exists():
        with MAPS.open() as f:
            if sum(1 for _ in f) > int(MAX_MAP_COUNT.read_text()) // 2:
                jax.clear_caches()
                gc.collect()  # the executables go (and their mappings with them) once nothing refers to them
    yield


@pytest.fixture(autouse=True)
def _libtpu_stays_out():
    """libtpu (a second XLA and LLVM) must never load into a pytest process: XLA:CPU compiles next to it segfaulted
    (issue 16). Ahead-of-time TPU7x compiles go through tests/aot_subprocess.py."""
    yield
    if MAPS.exists() and "/libtpu.so" in MAPS.read_text():
        pytest.fail("this test loaded libtpu into the pytest process: run its TPU compiles through "
                    "aot_subprocess.run (tests/aot_subprocess.py)", pytrace=False)


@pytest.fixture(scope="session")
def tiny():
    """`qwen3.5-tiny` in float32 with no EOS (greedy runs go to their length) and its random weights (seed 0); a
    module that needs another tiny model defines its own `tiny`."""
    from qwen35_lib import get_config, init_weights

    cfg = get_config("qwen3.5-tiny", dtype="float32", eos_token_ids=())
    return cfg, init_weights(cfg, 0)
