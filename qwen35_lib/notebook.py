"""What every notebook does before and after its chapter, as two calls.

    devices, SIZE = notebook.setup()          # after the install cell, before anything starts JAX's backend
    notebook.save_results("dp_ep", record)    # last cell: the figures the chapter quotes

`setup` gives the accelerator's own devices, or else 8 simulated CPU devices with patient collectives, and the
size the notebook runs at: "tpu" on a TPU, "cpu" otherwise, `$QWEN35_SIZE` overriding. `save_results` writes
`record` as `<name>.json` under `$QWEN35_RESULTS_DIR` when the playbook builder set it, and does nothing otherwise.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
from typing import Any

RESULTS_ENV = "QWEN35_RESULTS_DIR"
SIZE_ENV = "QWEN35_SIZE"
SIZES = ("cpu", "tpu")
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")  # TPU VMs (two drivers), NVIDIA


def has_accelerator() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def setup(cpu_devices: int = 8) -> tuple[list, str]:
    """(jax.devices(), size). Without an accelerator, `cpu_devices` simulated CPU devices; a RuntimeError when
    JAX already started a CPU backend with another count (the kernel must be restarted)."""
    import jax

    from qwen35_lib.devices import simulate_cpu_devices

    if not has_accelerator():
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
