"""Simulated CPU devices that survive a busy machine.

XLA:CPU runs each simulated device on its own thread. At a collective, the devices that arrived wait for the
others, and after 40 s (XLA's default) the process aborts: "Termination timeout ... Exiting to ensure a
consistent program state". On 2 cores running 8 devices, a second test process and a notebook kernel, a device
can fall that far behind without anything being wrong. `PATIENT_COLLECTIVES` waits 30 minutes instead; a real
deadlock is then caught by the caller's own timeout (pytest-timeout in the tests), with every thread's stack.

    from qwen35_lib.devices import simulate_cpu_devices
    simulate_cpu_devices(8)  # before JAX starts a backend; importing jax is fine

How many devices a multi-device layout runs on is the plan flags' to say (`qwen35_lib.plan.cli`: `--devices N`,
else `$QWEN35_DEVICES`, else every device present for a general layout and 8, a TPU7x-8's count, for an 8-device
name); `DEFAULT_DEVICES` is how many simulated CPU devices a command makes when nothing else says.
"""

from __future__ import annotations

import os

DEFAULT_DEVICES = 8  # a TPU7x-8: 4 chips x 2 TensorCores

PATIENT_COLLECTIVES = {  # XLA_FLAGS names of this jaxlib -> seconds
    "xla_cpu_collective_call_warn_stuck_timeout_seconds": 300,
    "xla_cpu_collective_call_terminate_timeout_seconds": 1800,
}


def with_patient_collectives(flags: str) -> str:
    """XLA_FLAGS `flags` with the `PATIENT_COLLECTIVES` timeouts added (a timeout already in `flags` is kept)."""
    words = flags.split()
    for name, seconds in PATIENT_COLLECTIVES.items():
        if not any(w.startswith(f"--{name}=") for w in words):
            words.append(f"--{name}={seconds}")
    return " ".join(words)


def patient_collectives() -> None:
    """Add the `PATIENT_COLLECTIVES` timeouts to `$XLA_FLAGS`. XLA reads them when it first compiles."""
    os.environ["XLA_FLAGS"] = with_patient_collectives(os.environ.get("XLA_FLAGS", ""))


def simulate_cpu_devices(count: int = 8) -> bool:
    """Before JAX starts a backend: `count` simulated CPU devices with patient collectives. Returns False (and
    changes nothing) when a backend is already running: its devices are what there is, restart to change them."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    patient_collectives()
    jax.config.update("jax_num_cpu_devices", count)
    return True
