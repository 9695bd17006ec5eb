"""A made-up system with round numbers (`toy`) for the cost model's hand-computed tests."""

from __future__ import annotations

from qwen35_lib.costmodel import specs

GB = 1e9


def toy(chips: int = 4, cores: int = 1, **changes) -> specs.Specs:
    """A made-up system with round numbers, so every expected value below is hand arithmetic."""
    base = dict(name="toy", kind="tpu", chip="toy", chips=chips, devices_per_chip=cores, peak_flops=100e12,
                hbm_bytes_per_s=1e12, hbm_bytes=64 * 2**30, usable_hbm_bytes=63 * 2**30, ici_link_bytes_per_s=100 * GB,
                links_per_neighbour=1, core_link_bytes_per_s=400 * GB if cores > 1 else None, ring="ring",
                hop_latency_s=1e-6,
                collective_launch_s=5e-6, eff_matmul=0.5, eff_hbm=0.8, eff_ici=1.0, vector_fraction=0.1)
    base.update(changes)
    return specs.Specs(**base)
