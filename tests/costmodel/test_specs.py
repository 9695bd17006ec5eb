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
