"""Hardware specs for the cost model: one `Specs` record per system, per device, in plain units.

Peak FLOP/s, HBM size and bandwidth come from `data/hardware.json` (through `qwen35_lib.hardware.get`); links,
latencies, topology and efficiency factors from `data/costmodel_hardware.json`. Every number keeps its
provenance (`source: ...`, `assumption: ...` or `measured: ...`) in `Specs.sources`. The `cpu` system is this
machine: its matmul FLOP/s, memory bandwidth and per-op dispatch cost are measured by `cpu_bench.measure()`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from qwen35_lib import data
from qwen35_lib import hardware as hw

FILE = "costmodel_hardware.json"


@dataclasses.dataclass(frozen=True)
class Specs:
    """One system, per JAX device unless named `_chip`. Bandwidths are one way (per direction), bytes/s."""

    name: str
    kind: str  # "tpu", "gpu", "cpu"
    chip: str
    chips: int
    devices_per_chip: int
    peak_flops: float  # bf16 MXU FLOP/s per device (our matmuls run in bf16: FP8 weights are upcast)
    hbm_bytes_per_s: float  # per device
    hbm_bytes: int  # per device
    usable_hbm_bytes: int  # per device: what a program may use (hardware.json's usable_hbm_bytes)
    ici_link_bytes_per_s: float  # one ICI link, one direction
    links_per_neighbour: int
    core_link_bytes_per_s: float | None  # between the cores of one chip (None: one device per chip)
    ring: str  # "ring" (chips in a ring) or "switch" (any device reaches any at full link bandwidth)
    hop_latency_s: float
    collective_launch_s: float
    eff_matmul: float
    eff_hbm: float
    eff_ici: float
    vector_fraction: float  # vector-unit FLOP/s as a fraction of the MXU peak
    op_overhead_s: float = 0.0  # fixed cost per launched op (measured on the CPU; 0 on accelerators, see sources)
    copy_bytes_per_s: float | None = None  # a materialized copy, read + write bytes (None: the HBM rate)
    small_matmul_flops: float | None = None  # matmuls with few rows per batch (None: peak x eff_matmul)
    dense_rows_flops: tuple[tuple[int, float], ...] = ()  # (rows, FLOP/s) of a dense dot with that many rows; ():
    # priced at the peak (accelerators; see sources)
    sources: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def devices(self) -> int:
        return self.chips * self.devices_per_chip

    @property
    def ring_link_bytes_per_s(self) -> float:
        """Bandwidth of one ring hop between chips, one direction."""
        return self.ici_link_bytes_per_s * self.links_per_neighbour

    @property
    def dense_row_efficiency(self) -> tuple[tuple[int, float], ...]:
        """((rows, measured FLOP/s of a dense dot with those rows over peak_flops x eff_matmul), ...): what
        `ops.row_efficiency` prices a dense projection with few rows by; () where none is measured."""
        return tuple((r, f / self.devices_per_chip / (self.peak_flops * self.eff_matmul))
                     for r, f in self.dense_rows_flops)

    def replace(self, **changes: Any) -> Specs:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["devices"] = self.devices
        return d


@functools.cache
def _table() -> dict:
    return data.read_json(FILE)


def _value(entry: dict, sources: dict, key: str) -> Any:
    kinds = [k for k in ("source", "assumption", "measured") if k in entry]
    if len(kinds) != 1:
        raise ValueError(f"{FILE} entry {key}: needs exactly one of source / assumption / measured, got {entry}")
    sources[key] = f"{kinds[0]}: {entry[kinds[0]]}"
    return entry["value"]


def efficiency() -> dict[str, float]:
    """The efficiency factors, name -> value (reasons in data/costmodel_hardware.json)."""
    return {k: v["value"] for k, v in _table()["efficiency"].items()}


def kernel_facts() -> dict[str, dict]:
    """What each kernel implementation moves, with its provenance (data/costmodel_hardware.json 'kernels')."""
    return dict(_table()["kernels"])


def get(name: str, cpu_measured: dict | None = None) -> Specs:
    """The `Specs` of system `name` (`tpu7x-8`, `v6e-8`, `v5p-8`, `v5e-8`, `h200`, `h200-8`, `cpu`).

    1. peak FLOP/s, HBM size and bandwidth per chip from `qwen35_lib.hardware`, divided by devices per chip;
    2. links, latencies, topology and efficiencies from data/costmodel_hardware.json;
    3. for `cpu`: the measured figures (`cpu_measured`, else `cpu_bench.measure()`, cached per process).
    """
    base = hw.get(name)
    table = _table()
    if base.chip not in table["chips"] or name not in table["systems"]:
        raise ValueError(f"hardware {name!r} has no cost-model entry in data/{FILE}")
    chip, system = table["chips"][base.chip], table["systems"][name]
    sources = {f"hardware.json:{k}": v for k, v in base.sources.items()}
    values = {k: _value(e, sources, k) for k, e in chip.items()}
    values.update({k: _value(e, sources, k) for k, e in system.items()})
    eff = {k: _value(e, sources, k) for k, e in table["efficiency"].items()}
    n = base.devices_per_chip
    peak = base.peak_bf16_flops_per_chip
    bw = base.hbm_bytes_per_s_per_chip
    overhead, extra = 0.0, {}
    sources["op_overhead_s"] = ("assumption: 0 on accelerators: a step is one compiled program whose ops run "
                                "back to back; gaps between ops are not modelled")
    sources["copy_bytes_per_s"] = "assumption: on accelerators a copy streams at the HBM rate (read + write)"
    sources["small_matmul_flops"] = "assumption: on accelerators no separate small-matmul regime is modelled"
    sources["dense_rows_flops"] = "assumption: on accelerators a matmul with few rows is priced at the peak"
    if base.kind == "cpu":
        from qwen35_lib.costmodel import cpu_bench

        m = cpu_measured or cpu_bench.measure()
        peak, bw, overhead = m["matmul_flops"], m["memory_bytes_per_s"], m["op_overhead_s"]
        extra = {k: m[k] for k in ("copy_bytes_per_s", "small_matmul_flops")}
        if "dense_rows_flops" in m:  # records measured before the table price every dot at the peak
            extra["dense_rows_flops"] = tuple(map(tuple, m["dense_rows_flops"]))
        values["ici_link_bytes_per_s"] = bw
        for k in ("peak_flops", "hbm_bytes_per_s", "op_overhead_s", *extra):
            sources[k] = f"measured: {cpu_bench.DESCRIPTIONS[k]}"
        eff = dict(eff, matmul_flops=1.0, hbm_bytes=1.0)
        sources["matmul_flops"] = sources["hbm_bytes"] = "measured: the CPU peaks are measured, so no efficiency factor"
        if "vector_flops" in m:  # the cores run vector work and matmuls alike: no MXU/VPU split to assume
            eff["vector_flops_fraction"] = m["vector_flops"] / m["matmul_flops"]
            sources["vector_flops_fraction"] = (f"measured: {cpu_bench.DESCRIPTIONS['vector_flops']}, over the "
                                                "matmul peak")
    return Specs(
        name=name, kind=base.kind, chip=base.chip, chips=base.chips, devices_per_chip=n,
        peak_flops=peak / n, hbm_bytes_per_s=bw / n, hbm_bytes=base.hbm_bytes_per_chip // n,
        usable_hbm_bytes=base.usable_hbm_bytes_per_device,
        ici_link_bytes_per_s=values["ici_link_bytes_per_s"], links_per_neighbour=values["links_per_neighbour"],
        core_link_bytes_per_s=values.get("core_link_bytes_per_s") if n > 1 else None, ring=values["ring"],
        hop_latency_s=values["hop_latency_s"], collective_launch_s=values["collective_launch_s"],
        eff_matmul=eff["matmul_flops"], eff_hbm=eff["hbm_bytes"], eff_ici=eff["ici_bytes"],
        vector_fraction=eff["vector_flops_fraction"], op_overhead_s=overhead, sources=sources, **extra)


def names() -> tuple[str, ...]:
    """Systems with a cost-model entry."""
    return tuple(n for n in hw.names() if n in _table()["systems"])
