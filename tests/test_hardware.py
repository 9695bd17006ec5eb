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


def test_capacity_is_the_one_formula_of_what_fits():
    """`hardware.capacity`: whole items of `each` bytes in `free` bytes, 0 when nothing is free or an item is free;
    the budget's and the cost model's counts read it."""
    from qwen35_lib import budget, get_config

    assert (hardware.capacity(10, 3), hardware.capacity(9.5, 3.0), hardware.capacity(-4, 3), hardware.capacity(9, 0)) \
        == (3, 3, 0, 0)
    b = budget.hbm_budget(get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn"), "tpu7x-8", 64, 9216)
    assert b.max_concurrency == hardware.capacity(b.free_bytes, 9216 * b.kv_bytes_per_token
                                                  + b.gdn_state_bytes_per_seq)
