"""serve.metrics: the Prometheus exposition under vLLM's metric names, the gauges read from the loop's stats, and
the preemption counter catching up with the loop's count."""

import pytest

pytest.importorskip("prometheus_client")

from qwen35_lib.serve.metrics import Metrics  # noqa: E402


class Loop:
    def __init__(self):
        self.s = dict(running=2, waiting=5, free_pages=30, total_pages=40, preemptions=0)

    def stats(self):
        return self.s


def value(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_exposition_reads_the_loop_and_counts_what_it_is_told():
    loop = Loop()
    m = Metrics(loop, "tiny")
    m.prompt_tokens.inc(7)
    m.token_gap(0.01)
    m.finished("stop")
    text = m.text().decode()
    assert value(text, "vllm:num_requests_running") == 2 and value(text, "vllm:num_requests_waiting") == 5
    assert value(text, "vllm:kv_cache_usage_perc") == pytest.approx(1 - 30 / 40)
    assert value(text, "vllm:prompt_tokens_total") == 7
    assert value(text, "vllm:time_per_output_token_seconds_count") == 1
    assert value(text, "vllm:inter_token_latency_seconds_count") == 1
    assert 'finished_reason="stop"' in text and value(text, "vllm:num_preemptions_total") == 0
    loop.s["preemptions"] = 3
    assert value(m.text().decode(), "vllm:num_preemptions_total") == 3
    assert value(m.text().decode(), "vllm:num_preemptions_total") == 3  # read again: not counted twice
