"""costmodel.specs: every hardware constant says where it comes from."""

from __future__ import annotations

from qwen35_lib.costmodel import specs


def test_every_constant_has_provenance():
    for name in specs.names():
        if name == "cpu":
            continue
        sp = specs.get(name)
        assert all(v.split(":")[0] in ("source", "assumption", "measured") for v in sp.sources.values()), name
    assert set(specs.kernel_facts()) >= {"xla_weight_passes", "moe_xla_reads_all_local_experts"}


def test_cpu_vector_work_is_priced_at_its_measured_rate():
    """The CPU runs vector work on the same cores as its matmuls: its vector fraction is the measured element-wise
    rate over the measured matmul peak, not the TPU's assumed VPU share (kept for records measured before)."""
    m = dict(matmul_flops=100e9, memory_bytes_per_s=20e9, op_overhead_s=1e-6, copy_bytes_per_s=10e9,
             small_matmul_flops=50e9, vector_flops=25e9)
    sp = specs.get("cpu", m)
    assert sp.vector_fraction == 0.25 and sp.sources["vector_flops_fraction"].startswith("measured")
    older = {k: v for k, v in m.items() if k != "vector_flops"}
    assert specs.get("cpu", older).vector_fraction == specs.efficiency()["vector_flops_fraction"]


def test_cpu_few_row_rates_are_measured_and_read_over_the_peak():
    """The CPU's few-rows table comes from `cpu_bench` (measured, with its description) and is read as rates over
    the peak; a record measured before it prices every dot at the peak; accelerators have none."""
    m = dict(matmul_flops=100e9, memory_bytes_per_s=20e9, op_overhead_s=1e-6, copy_bytes_per_s=10e9,
             small_matmul_flops=50e9, vector_flops=25e9, dense_rows_flops=[[32, 50e9], [256, 100e9]])
    sp = specs.get("cpu", m)
    assert sp.dense_row_efficiency == ((32, 0.5), (256, 1.0)) and hash(sp)
    assert sp.sources["dense_rows_flops"].startswith("measured")
    older = {k: v for k, v in m.items() if k != "dense_rows_flops"}
    assert specs.get("cpu", older).dense_row_efficiency == () == specs.get("tpu7x-8").dense_row_efficiency
