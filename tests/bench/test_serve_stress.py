"""`python -m qwen35_lib.bench serve-stress` end to end at a tiny size: it builds its own server (the tiny random
model, a tokenizer written to a temporary folder), runs every load, prints its table and writes its JSON with the
expected keys. The latencies' magnitudes are the benchmark's to report, never a test's to bound."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("tokenizers")

from qwen35_lib.bench.__main__ import main  # noqa: E402
from qwen35_lib.bench.serve_stress import abusive_bodies  # noqa: E402

HEALTH = {"probes", "p50_ms", "max_ms", "not_200"}
STREAM = {"gaps", "p50_gap_ms", "max_gap_ms"}


def test_serve_stress_runs_and_writes_its_latencies(tmp_path, capsys):
    out = tmp_path / "stress.json"
    assert main(["serve-stress", "--body-scale", "0.0005", "--random-bodies", "6", "--stream-tokens", "4",
                 "--warmup", "none", "--json", str(out)]) == 0  # no 5xx, no short stream, /health always 200
    printed = capsys.readouterr().out
    assert "serve-stress" in printed and "p50 ms" in printed and "gap max ms" in printed
    doc = json.loads(out.read_text())
    assert {"machine", "server", "idle", "beside_stream", "all_at_once", "random_bodies", "whole_run", "failures",
            "wall_s", "command"} <= set(doc)
    for when in ("before", "after"):
        assert {"cpu_count", "loadavg", "process_cpu_s"} <= set(doc["machine"][when])
        assert len(doc["machine"][when]["loadavg"]) == 3
    names = list(abusive_bodies(0.0005))
    assert [r["name"] for r in doc["beside_stream"]] == names
    for part in (*doc["beside_stream"], doc["all_at_once"], doc["random_bodies"], doc["whole_run"], doc["idle"]):
        assert set(part["health"]) == HEALTH and set(part["stream"]) == STREAM
    for part in (*doc["beside_stream"], doc["all_at_once"], doc["random_bodies"]):
        assert part["statuses"] and all(int(s) < 500 for s in part["statuses"])
    assert doc["whole_run"]["health"]["probes"] > 0 and doc["whole_run"]["stream"]["gaps"] > 0
    assert sum(doc["random_bodies"]["statuses"].values()) == 6
    assert doc["failures"] == {"server_errors": 0, "short_streams": 0, "stream_errors": [], "health_not_200": 0}


def test_abusive_bodies_keep_their_sizes_at_scale_one():
    """The full-size loads are the tests' (an 8 MB prompt, 4,000 prompts, four 400k-word lists, ...)."""
    groups = abusive_bodies(1.0)
    body = lambda name, i=0: json.loads(groups[name][i][1])
    assert len(body("prompt_8MB_chars")["prompt"]) == 8 << 20 and len(body("prompts_4000")["prompt"]) == 4000
    assert len(groups["bad_words_400k_x4"]) == 4 and len(body("bad_words_400k_x4", 3)["bad_words"]) == 400_000
    assert len(body("stop_1M_strings")["stop"]) == 1_000_000
