"""`python -m qwen35_lib.bench serve` against our server on loopback: vllm bench serve's result keys, a result file
per run that `recipe --result` reads, a plot, and greedy outputs equal to the engine's for the same prompts."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from qwen35_lib import recipe  # noqa: E402
from qwen35_lib.bench.__main__ import main  # noqa: E402
from qwen35_lib.engine import Engine, SamplingParams  # noqa: E402
from tests import serve_support  # noqa: E402
from tests.serve_support import EC  # noqa: E402

KEYS = ["completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "total_input_tokens", "total_output_tokens", "max_concurrency", "num_prompts"] + \
    [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")]


def test_bench_serve_against_our_server(tmp_path, capsys):
    with serve_support.running(tmp_path / "tok") as s:
        out, plot, results = tmp_path / "serve.json", tmp_path / "serve.png", tmp_path / "results"
        assert main(["serve", "--base-url", s.url, "--concurrency", "1", "8", "--workloads", "1k/1k", "--scale",
                     "1/64", "--num-prompts", "8", "--save-detailed", "--json", str(out), "--plot", str(plot),
                     "--result-dir", str(results), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "TTFT ms" in printed and "TPOT ms" in printed and "ITL ms" in printed and "out tok/s" in printed
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert [r["concurrency"] for r in runs] == [1, 8] and plot.stat().st_size > 0
    for r in runs:
        assert set(KEYS) <= set(r) and r["completed"] == 8 and r["failed"] == 0
        assert r["total_output_tokens"] == sum(r["max_tokens"])  # EOS ignored: every request ran its length
        assert r["median_ttft_ms"] > 0 and r["median_itl_ms"] > 0 and r["output_throughput"] > 0
        # greedy: each output equals the engine's for the same prompt
        e = Engine(s.config, s.weights, EC)
        e.decode_buckets = (EC.max_num_seqs,)
        want = e.generate(r["prompts"], [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in r["max_tokens"]])
        assert r["token_ids"] == [w.output_ids for w in want]
    files = sorted(results.glob("*.json"))
    assert len(files) == 2
    loaded = recipe.load_result(files[0])  # read as a vllm bench serve --save-result file
    assert loaded["workload"] == "1k/1k" and loaded["max_concurrency"] in (1, 8)
