"""Ahead-of-time compiles for TPU7x on any machine: the `tpu7x:2x2x1` topology (libtpu, the `tpu` extra).

`get_topology_desc` describes the 8 TensorCores of a TPU7x-8 (4 chips x 2 cores) without a TPU; programs
lowered against them with `jax.ShapeDtypeStruct` inputs compile for real (Mosaic included) and allocate
nothing, so per-device memory (`memory_analysis()`), FLOPs and bytes (`cost_analysis()`) and the compiled
collectives can be read at the full 397B size.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qwen35_lib.config import Config
from qwen35_lib.kernels.registry import SLOTS, resolve_name
from qwen35_lib.weights import abstract_weights

TPU7X_8 = "tpu7x:2x2x1"


@functools.lru_cache(maxsize=4)
def topology_devices(topology: str = TPU7X_8) -> tuple:
    """The devices of a TPU topology description (needs libtpu: `pip install 'qwen35-playbook[tpu]'`)."""
    # libtpu takes /tmp/libtpu_lockfile for the whole process; without this, a second process (a notebook
    # kernel next to a test run) cannot load it. Nothing here drives a real TPU, so sharing is safe.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):  # no TPU here: quiet libtpu's probing
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    from jax.experimental import topologies

    try:
        return tuple(topologies.get_topology_desc(topology, "tpu").devices)
    except Exception as e:  # libtpu missing or the name unknown
        raise RuntimeError(f"cannot describe TPU topology {topology!r} ({e}); ahead-of-time TPU compiles need "
                           "libtpu: pip install 'jax[tpu]' (the project's 'tpu' extra)") from e


def chip_core_mesh(devices) -> Mesh:
    """The playbook's `('chip', 'core')` mesh, ordered chip-major, core-minor by physical coordinates."""
    devs = sorted(devices, key=lambda d: (tuple(reversed(d.coords)), d.core_on_chip))
    cores = max(d.core_on_chip for d in devs) + 1
    return Mesh(np.array(devs).reshape(-1, cores), ("chip", "core"))


def for_backend(config: Config, backend: str) -> Config:
    """`config` with every "auto" kernel resolved for `backend` (tracing happens on this CPU, so say it)."""
    fields = {("moe_kernel" if s == "moe_matmul" else f"{s}_kernel"): s for s in SLOTS}
    return dataclasses.replace(config, **{f: resolve_name(s, getattr(config, f), backend) for f, s in fields.items()})


def compile_forward(config: Config, batch: int, seq: int, topology: str = TPU7X_8):
    """`forward` compiled for one device of `topology` with abstract weights; returns the compiled executable."""
    from qwen35_lib.model.decoder import _forward

    device = topology_devices(topology)[0]
    one = jax.sharding.SingleDeviceSharding(device)
    weights = abstract_weights(config, jax.tree.map(lambda _: one, abstract_weights(config)))
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=one)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=one)
    return _forward.lower(for_backend(config, "tpu"), weights, ids, lengths).compile()
