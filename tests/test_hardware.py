"""qwen35_lib.hardware: every system in the table has provenance for its figures."""

from __future__ import annotations

from qwen35_lib import hardware

GiB = 2**30


def test_hardware_table_has_provenance():
    for name in hardware.names():
        h = hardware.get(name)
        assert h.devices >= 1 and h.hbm_bytes_per_device > 0
        assert set(h.sources) >= {"chips", "hbm_bytes", "peak_bf16_flops", "peak_fp8_flops", "hbm_bytes_per_s"}
        assert all(s.split(":")[0] in ("source", "assumption", "measured") for s in h.sources.values())
    assert set(hardware.names()) >= {"tpu7x-8", "v6e-8", "v5p-8", "v5e-8", "h200", "h200-8", "cpu"}
    tpu = hardware.get("tpu7x-8")
    assert (tpu.chips, tpu.devices, tpu.hbm_bytes_per_chip) == (4, 8, 192 * GiB)
    assert hardware.get("cpu").hbm_bytes == hardware.host_memory_bytes()
