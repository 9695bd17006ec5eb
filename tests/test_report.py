"""qwen35_lib.report: the active parameters per token count top-k of the routed experts."""

from __future__ import annotations

from qwen35_lib.config import get_config
from qwen35_lib.report import active_params_by_part


def test_active_breakdown_counts_top_k_of_the_routed_experts():
    cfg = get_config("qwen3.5-397b-a17b")
    parts = active_params_by_part(cfg)
    assert parts["routed_experts"] == 60 * 10 * 3 * 4096 * 1024
    assert sum(parts.values()) == 17_349_040_896
