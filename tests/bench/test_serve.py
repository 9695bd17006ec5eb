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


def test_bench_serve_takes_vllm_flags_drives_chat_and_fails_when_requests_fail(tmp_path, capsys):
    """vllm bench serve's flags (--max-concurrency, --request-rate, --burstiness, the random dataset's lengths,
    --goodput, --metric-percentiles, --save-result, --result-filename, --metadata, --disable-tqdm, --ignore-eos,
    --trust-remote-code, --backend openai-chat), the chat endpoint's outputs equal to the engine's on the
    chat-templated prompts; every request failing exits non-zero."""
    with serve_support.running(tmp_path / "tok") as s:
        out, results = tmp_path / "chat.json", tmp_path / "res"
        argv = ["serve", "--base-url", s.url, "--backend", "openai-chat", "--max-concurrency", "2", "--request-rate",
                "40", "--burstiness", "2", "--dataset-name", "random", "--random-input-len", "8", "--random-output-len",
                "4", "--random-range-ratio", "0.5", "--trust-remote-code", "--num-prompts", "3",
                "--num-warmups", "0", "--goodput", "ttft:600000", "e2el:600000", "--metric-percentiles", "50,99",
                "--save-result", "--result-dir", str(results), "--result-filename", "mine.json", "--metadata",
                "run=ci", "--disable-tqdm", "--ignore-eos", "--save-detailed", "--tokenizer", str(tmp_path / "tok"),
                "--json", str(out)]
        assert main(argv) == 0
        run = json.loads(out.read_text())["runs"][0]
        assert run["completed"] == 3 and run["request_rate"] == 40 and run["max_concurrency"] == 2
        assert run["request_goodput"] > 0 and "p50_ttft_ms" in run and "p99_e2el_ms" in run and run["run"] == "ci"
        assert run["endpoint"] == "/v1/chat/completions" and (results / "mine.json").is_file()
        assert run["input_range"] == [4, 12] and run["output_range"] == [2, 6] and run["workload"] == "random_8_4"
        assert all(4 <= len(p) <= 12 for p in run["prompts"]) and all(2 <= m <= 6 for m in run["max_tokens"])
        for ids, m, got in zip(run["prompts"], run["max_tokens"], run["token_ids"]):
            prompt = s.text.encode_chat([{"role": "user", "content": s.text.decode(ids)}])
            assert got == s.alone(prompt, m)
        capsys.readouterr()
        bad = ["serve", "--base-url", s.url, "--model", "no-such-model", "--concurrency", "1", "--num-prompts", "2",
               "--num-warmups", "0", "--scale", "1/128", "--disable-tqdm", "--json", str(tmp_path / "bad.json")]
        assert main(bad) == 1
        err = capsys.readouterr().err
        assert "2 of 2 requests failed" in err and "404" in err
        assert json.loads((tmp_path / "bad.json").read_text())["runs"][0]["failed"] == 2
