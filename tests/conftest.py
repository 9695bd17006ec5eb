"""Test setup: 8 simulated CPU devices, forced before jax is imported anywhere."""

import os

from qwen35_lib.devices import patient_collectives

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
patient_collectives()  # a simulated device that lags behind on a busy machine must not abort the test process
# With JAX_COMPILATION_CACHE_DIR set (the Makefile no longer sets it: writing CPU executables into it segfaulted
# now and then), one persistent cache per pytest-xdist worker: two processes writing one entry at once crashed.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] += "-" + os.environ["PYTEST_XDIST_WORKER"]

import jax  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
