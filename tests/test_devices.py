"""Simulated devices wait for a lagging device at a collective instead of aborting the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from qwen35_lib.devices import PATIENT_COLLECTIVES, with_patient_collectives

LAGGING_DEVICE = textwrap.dedent("""
    import sys, time
    from qwen35_lib.devices import patient_collectives, simulate_cpu_devices
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    assert simulate_cpu_devices(8)
    mesh = jax.make_mesh((8,), ("x",))

    def step(a):  # device 0 reaches the psum 3 s after the others
        slow = lambda a: jax.pure_callback(lambda v: (time.sleep(3), v)[1], jax.ShapeDtypeStruct(a.shape, a.dtype), a)
        a = jax.lax.cond(jax.lax.axis_index("x") == 0, slow, lambda a: a, a)
        return jax.lax.psum(a, "x")

    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("x")))
    out = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)
    print(float(out.sum()))
""")


def test_flags_added_once_and_explicit_ones_kept():
    flags = with_patient_collectives("--xla_cpu_collective_call_terminate_timeout_seconds=7 --xla_foo=1")
    words = flags.split()
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=7" in words and "--xla_foo=1" in words
    assert len(words) == 2 + len(PATIENT_COLLECTIVES) - 1
    assert with_patient_collectives(flags) == flags
    assert all(f"--{name}=" in os.environ["XLA_FLAGS"] for name in PATIENT_COLLECTIVES)  # conftest set them


def run_lagging(xla_flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", LAGGING_DEVICE], env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_lagging_device_is_waited_for():
    """XLA reads these flag names (a short terminate timeout aborts the process, as the 40 s default does on a
    busy machine), and the patient ones let the same program finish."""
    short = run_lagging("--xla_cpu_collective_call_terminate_timeout_seconds=1 "
                        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1")
    assert short.returncode != 0 and "Termination timeout" in short.stderr, short.stderr[-2000:]
    patient = run_lagging("")
    assert patient.returncode == 0, patient.stderr[-2000:]
    assert patient.stdout.split()[-1] == "256.0"
