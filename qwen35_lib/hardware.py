"""The hardware table: chips and the systems built from them, read from `data/hardware.json`.

Every number in that file carries its `source` (or an `assumption` with its reason); `get(name)` turns one
system into a `Hardware` record in plain units (bytes, bytes/s, FLOP/s). The `cpu` system is this machine:
its memory is measured when read, never typed in. The file's `_schema` note describes the format.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any

from qwen35_lib import data

_FIELDS = ("devices_per_chip", "hbm_bytes", "hbm_bytes_per_s", "peak_bf16_flops", "peak_fp8_flops")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One system (`tpu7x-8`, `h200`, `cpu`, ...): `chips` copies of one chip. Per-chip figures; None = unknown."""

    name: str
    description: str
    kind: str  # "tpu", "gpu" or "cpu"
    chip: str
    chips: int
    devices_per_chip: int  # JAX devices per chip (TPU7x: 2 TensorCores; v5p: 1 megacore)
    hbm_bytes_per_chip: int
    hbm_bytes_per_s_per_chip: float | None
    peak_bf16_flops_per_chip: float | None
    peak_fp8_flops_per_chip: float | None
    sources: dict[str, str]  # field -> "source: ...", "assumption: ..." or "measured: ..."
    usable_hbm_bytes_per_chip: int = 0  # what programs may use (the runtime keeps the rest); 0: all of it

    @property
    def usable_hbm_bytes_per_device(self) -> int:
        """The HBM a program on one device may use: where every fit is judged."""
        return (self.usable_hbm_bytes_per_chip or self.hbm_bytes_per_chip) // self.devices_per_chip

    @property
    def devices(self) -> int:
        return self.chips * self.devices_per_chip

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.hbm_bytes_per_chip // self.devices_per_chip

    @property
    def hbm_bytes(self) -> int:
        """All memory of the system."""
        return self.hbm_bytes_per_chip * self.chips

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(devices=self.devices, hbm_bytes_per_device=self.hbm_bytes_per_device, hbm_bytes=self.hbm_bytes,
                 usable_hbm_bytes_per_device=self.usable_hbm_bytes_per_device)
        return d


def data_path() -> pathlib.Path:
    """`hardware.json`: the package's (`qwen35_lib.data`), or `$QWEN35_DATA_DIR`'s when it holds one."""
    return data.path("hardware.json")


@functools.cache
def _table() -> dict:
    return data.read_json("hardware.json")


def names() -> tuple[str, ...]:
    """The system names `get` accepts, in the file's order."""
    return tuple(_table()["systems"])


def host_memory_bytes() -> int:
    """This machine's RAM: MemTotal from /proc/meminfo, else page size x physical pages."""
    meminfo = pathlib.Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                value, unit = line.split()[1:3]
                assert unit == "kB", line  # the kernel's "kB" is KiB
                return int(value) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def capacity(free_bytes: float, each_bytes: float) -> int:
    """How many items of `each_bytes` fit in `free_bytes`: 0 when nothing is free or an item costs nothing. The one
    capacity formula (`budget.HbmBudget.max_concurrency` and its kin, the cost model's requests a rank holds)."""
    return int(max(free_bytes, 0) // each_bytes) if each_bytes > 0 else 0


def get(name: str) -> Hardware:
    """The system `name` (`tpu7x-8`, `v6e-8`, `v5p-8`, `v5e-8`, `h200`, `h200-8`, `cpu`)."""
    table = _table()
    if name not in table["systems"]:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(table['systems'])} (see {data_path()})")
    system = table["systems"][name]
    chip = table["chips"][system["chip"]]
    sources = {"chips": _provenance(system["chips"])}
    values: dict[str, Any] = {}
    for field in _FIELDS:
        entry = chip[field]
        sources[field] = _provenance(entry)
        value = entry["value"]
        if "measured" in entry:
            value = _measure(field)
        values[field] = value
    if values["hbm_bytes"] is None:
        raise ValueError(f"hardware {name!r} has no memory size in {data_path()}")
    usable, sources["usable_hbm_bytes"] = _usable(table, chip, values["hbm_bytes"])
    return Hardware(
        name=name, description=system["description"], kind=chip["kind"], chip=system["chip"],
        chips=int(system["chips"]["value"]), devices_per_chip=int(values["devices_per_chip"]),
        hbm_bytes_per_chip=int(values["hbm_bytes"]), hbm_bytes_per_s_per_chip=values["hbm_bytes_per_s"],
        peak_bf16_flops_per_chip=values["peak_bf16_flops"], peak_fp8_flops_per_chip=values["peak_fp8_flops"],
        sources=sources, usable_hbm_bytes_per_chip=usable)


def _usable(table: dict, chip: dict, hbm_bytes: int) -> tuple[int, str]:
    """(usable bytes per chip, provenance): the chip's own figure, else tpu7x's usable fraction of its HBM."""
    if "usable_hbm_bytes" in chip:
        return int(chip["usable_hbm_bytes"]["value"]), _provenance(chip["usable_hbm_bytes"])
    ref = table["chips"]["tpu7x"]
    fraction = ref["usable_hbm_bytes"]["value"] / ref["hbm_bytes"]["value"]
    return int(hbm_bytes * fraction), (f"assumption: not known for this chip; tpu7x's usable fraction "
                                       f"({fraction:.4f} of its HBM, the compiler's figure) is assumed")


def _provenance(entry: dict) -> str:
    kinds = [k for k in ("source", "assumption", "measured") if k in entry]
    if len(kinds) != 1:
        raise ValueError(f"hardware.json entry {entry} needs exactly one of source / assumption / measured")
    return f"{kinds[0]}: {entry[kinds[0]]}"


def _measure(field: str) -> int:
    if field == "hbm_bytes":
        return host_memory_bytes()
    raise ValueError(f"hardware.json asks to measure {field!r}, which qwen35_lib.hardware cannot measure")
