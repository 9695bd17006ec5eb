"""The playbook's mesh: a TPU7x-8 is 4 chips x 2 TensorCores, so 8 JAX devices on axes `('chip', 'core')`.

Any device count forms the same axes (1 device: `chip` 1 x `core` 1; 2: 1 x 2; 4: 2 x 2; 16: 8 x 2). An axis
over every device is the product `ALL = ('chip', 'core')`; a collective over `core` stays inside a chip, one over `chip`
crosses the inter-chip links. The same mesh shape is built from 8 simulated CPU devices, from a real TPU's
devices (ordered by physical coordinates), or from the `tpu7x:2x2x1` topology description (ahead-of-time);
`abstract_mesh(n)` is its shape alone (no devices), what the cost model, placement and the CLIs' checks read.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

AXES = ("chip", "core")
ALL = ("chip", "core")  # an axis over every device: both mesh axes, chip-major


def make_mesh(devices: Sequence | None = None, cores_per_chip: int = 2) -> Mesh:
    """The `('chip', 'core')` mesh over `devices` (default: all devices of the default backend).

    1. TPU devices (real or from a topology description) are sorted by chip coordinates, then `core_on_chip`,
       so that mesh row i holds the two TensorCores of one chip;
    2. other devices (CPU, GPU) are taken in id order, `cores_per_chip` consecutive ones forming a "chip"
       (one device: a chip of one core);
    3. axes are `Auto` (GSPMD propagates shardings; `shard_map` names them explicitly).
    """
    devices = list(jax.devices() if devices is None else devices)
    if all(hasattr(d, "coords") and hasattr(d, "core_on_chip") for d in devices):
        devices.sort(key=lambda d: (tuple(reversed(d.coords)), d.core_on_chip))
        cores_per_chip = max(d.core_on_chip for d in devices) + 1
    else:
        devices.sort(key=lambda d: d.id)
        cores_per_chip = min(cores_per_chip, len(devices))
    if len(devices) % cores_per_chip:
        raise ValueError(f"{len(devices)} devices do not form whole chips of {cores_per_chip} cores; pass "
                         "cores_per_chip=1 or a device count that is a multiple of it")
    grid = np.array(devices, dtype=object).reshape(-1, cores_per_chip)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)


def abstract_mesh(devices: int) -> AbstractMesh:
    """The `('chip', 'core')` mesh of `devices` devices as sizes only, 2 cores a chip (1 device: one core)."""
    return AbstractMesh((max(1, devices // 2), min(2, devices)), AXES)


def axis_size(mesh, axes: str | tuple[str, ...] | None) -> int:
    """Devices along `axes` (a name, a tuple of names, or None = 1)."""
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in names]))


__all__ = ["ALL", "AXES", "abstract_mesh", "axis_size", "make_mesh"]
