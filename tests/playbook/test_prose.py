"""playbook.prose: the scan for figures typed into prose flags them and passes definitions and quoted results;
the backend check flags a CPU figure told as a TPU one."""

from __future__ import annotations

import pytest

from playbook import prose


@pytest.mark.parametrize("text", [
    "needs its 120 GiB of replicated KV cache", "with about 10 GiB left", "84 GiB per device", "a 7x gain",
    "grows by 3.1x", "moves seven times the bytes", "takes 34 s on 2 cores", "a 2k-token chunk", "45% of the step",
    "streams ~3.7 TB/s", "1.15 PFLOP/s of bf16", "about 300 requests", "costs 0.7 ms", "moves 64 MB",
    "three requests through both", "Twice the tokens"])
def test_the_scan_flags_typed_figures(text: str) -> None:
    bad, _ = prose.typed_figures(text, "x.md")
    assert bad, f"not flagged: {text!r}"


@pytest.mark.parametrize("text", [
    "serves {{ result: 02.dp_ep.stages.dp_ep.8k/1k.gain | x }} the baseline", "512 concurrent requests",
    "requests of 8k tokens", "8 x 96 GiB of HBM", "`tpu7x:2x2x1`", "qwen3.5-397b-a17b", "the 8k/1k workload",
    "`W[E_x, D, F]` on 8 devices", "one request", "a 2x2x1 slice", "{{ result: 01.naive_tp.kv_factor }} copies",
    "<div style=\"border: 2px solid\">", "{{ source: qwen35_lib/costmodel }}"])
def test_the_scan_passes_definitions_and_results(text: str) -> None:
    bad, _ = prose.typed_figures(text, "x.md")
    assert not bad, bad


def test_the_backend_check_flags_a_cpu_figure_told_as_a_tpu_one() -> None:
    text = "On a TPU7x the ratio is {{ result: 01.naive_tp.cpu_kv_ratio | .2f }}.\n\nOn this CPU: " \
           "{{ result: 01.naive_tp.cpu_kv_ratio }}; on TPU7x {{ result: 01.naive_tp.tpu_kv_ratio }}."
    assert prose.backend_mismatches(text, "x.md") == [
        "x.md: 01.naive_tp.cpu_kv_ratio (labelled CPU) in a paragraph that does not say CPU"]
    assert prose.key_backend("05.kernel_swaps.cpu.1.max_abs_diff_vs_xla") == "CPU"
    assert prose.key_backend("02.dp_ep.collectives_per_group.CPU.all-to-all.count") == "CPU"
    assert prose.key_backend("06.costmodel.ladder.0.total_tokens_per_s") is None
