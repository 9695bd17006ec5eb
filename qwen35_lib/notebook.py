"""What every notebook does before and after its chapter, as two calls.

    devices, SIZE = notebook.setup()          # after the install cell, before anything starts JAX's backend
    notebook.save_results("dp_ep", record)    # last cell: the figures the chapter quotes

`setup` gives the accelerator's own devices when it has the 8 the chapters' layouts need, or else 8 simulated CPU
devices with patient collectives (a one-device Colab TPU or GPU runtime says so and runs the chapter at CPU size),
and the size the notebook runs at: "tpu" on a TPU, "cpu" otherwise, `$QWEN35_SIZE` overriding. `save_results` writes
`record` as `<name>.json` under `$QWEN35_RESULTS_DIR` when the playbook builder set it, and does nothing otherwise.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

RESULTS_ENV = "QWEN35_RESULTS_DIR"
SIZE_ENV = "QWEN35_SIZE"
SIZES = ("cpu", "tpu")
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")  # TPU VMs (two drivers), NVIDIA


def has_accelerator() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def accelerator_device_count() -> int:
    """Devices JAX finds on this machine's accelerator (0: none), counted in a child process so that this one can
    still choose its backend."""
    if not has_accelerator():
        return 0
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"], capture_output=True,
                           text=True, timeout=600)
    lines = probe.stdout.split()
    if probe.returncode or not lines or not lines[-1].isdigit():
        print(f"the accelerator did not start JAX ({(probe.stderr.strip().splitlines() or ['no message'])[-1]}); "
              "running on the CPU")
        return 0
    return int(lines[-1])


def setup(cpu_devices: int = 8) -> tuple[list, str]:
    """(jax.devices(), size). An accelerator with at least `cpu_devices` devices runs the chapter; with fewer (a
    one-device Colab runtime) or none, `cpu_devices` simulated CPU devices do. A RuntimeError when JAX already
    started a CPU backend with another count (the kernel must be restarted)."""
    import jax

    from qwen35_lib.devices import simulate_cpu_devices

    found = accelerator_device_count()
    if 0 < found < cpu_devices:
        print(f"{found} accelerator device(s), fewer than the {cpu_devices} this chapter's layouts place work on: "
              f"it runs on {cpu_devices} simulated CPU devices at CPU size instead")
        jax.config.update("jax_platforms", "cpu")
    if found < cpu_devices:
        simulate_cpu_devices(cpu_devices)  # collectives wait for a slow simulated device instead of aborting
    devices = jax.devices()
    if devices[0].platform == "cpu" and len(devices) != cpu_devices:
        raise RuntimeError(f"JAX started with {len(devices)} CPU devices, not {cpu_devices}: restart the kernel and "
                           "run notebook.setup() before anything else uses JAX")
    size = os.environ.get(SIZE_ENV) or ("tpu" if devices[0].platform == "tpu" else "cpu")
    if size not in SIZES:
        raise ValueError(f"${SIZE_ENV}={size!r}: use one of {', '.join(SIZES)}")
    print(f"{len(devices)} x {devices[0].device_kind}; size: {size}")
    return devices, size


def save_results(name: str, record: dict[str, Any]) -> pathlib.Path | None:
    """`record` as `$QWEN35_RESULTS_DIR/<name>.json` (the path), or None when the variable is unset."""
    folder = os.environ.get(RESULTS_ENV)
    if not folder:
        return None
    path = pathlib.Path(folder, f"{name}.json")
    path.write_text(json.dumps(record, indent=2))
    return path
