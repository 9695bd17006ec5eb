"""The engine benchmark: the harness runs end to end at tiny size (the zero-experts ablation included) and writes
its JSON and plot; the workloads.

No timing assertions (benchmarks measure, they do not judge): structure, exact lengths, and agreement only.
"""

import json

import pytest

from qwen35_lib.bench import closed_loop
from qwen35_lib.bench.__main__ import main
from qwen35_lib.kernels import available

RUN_KEYS = {"workload", "concurrency", "output_tokens_per_s", "total_tokens_per_s", "ttft_ms", "tpot_ms", "steps",
            "mean_tokens_per_step", "preemptions", "traces", "buckets", "decode_tokens_per_s", "time_s", "compile",
            "input_tokens", "output_tokens", "wall_s", "per_step", "decode_roofline"}


def _check_doc(doc, concurrency, plot):
    assert doc["benchmark"] == "engine" and doc["model"] == "qwen3.5-tiny" and doc["scale"] == "1/64"
    assert {"workloads", "engine_configs", "runs", "decode_scaling", "vs_transformers", "environment",
            "plot"} <= set(doc)
    assert [(r["workload"], r["concurrency"]) for r in doc["runs"]] == [("1k/1k", n) for n in concurrency]
    for r in doc["runs"]:
        assert RUN_KEYS <= set(r)
        assert r["traces"] == 0 and not r["remeasured"]  # precompile compiled every bucket the measured run used
        assert sorted(r["buckets"]) == sorted(r["compile"]["buckets"])
        split = r["per_step"]["decode"]
        assert split["steps"] == r["decode_steps"] and 0 <= split["host_fraction"] < 1
        assert split["jitted_ms"]["p50"] <= split["wall_ms"]["p50"]
        roof = r["decode_roofline"]
        assert roof["mean_bytes_per_step"] > roof["mean_bytes_by_part"]["dense_weights"] > 0
        assert roof["fraction_of_jitted"] >= roof["fraction_of_step"] > 0
        assert r["preemptions"] == 0 and r["steps"] >= 13
        prof = r["profile"]  # the replay under jax.profiler: every step matched, both kinds split in components
        assert prof["profiled_steps"] == r["steps"] and prof["decode"]["steps"] == r["decode_steps"]
        for kind in ("decode", "prefill"):
            rows = {row["component"]: row for row in prof[kind]["rows"]}
            assert {"dense matmuls", "MoE", "GDN", "attention", "sampling", "host (measured run)"} <= set(rows)
            assert rows["dense matmuls"]["ms"] > 0 and rows["MoE"]["floor_ms"] > 0 and prof[kind]["floor_ms"] > 0
        assert r["load"]["cores"] >= 1 and "withhold_ratios" in r["load"]
        for kind, a in ((k, v) for k, v in r.get("ablation", {}).items() if k != "load"):  # the zero-experts rerun
            assert a["with_ms"] == r["per_step"][kind]["jitted_ms"]["p50"] and a["without_ms"] > 0
            assert a["experts_ms"] == a["with_ms"] - a["without_ms"] and a["share"] < 1
        assert r["input_tokens"] == r["concurrency"] * 16 or 13 * r["concurrency"] <= r["input_tokens"]
        assert r["output_tokens_per_s"] > 0 and r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert doc["engine_configs"][str(r["concurrency"])]["max_num_seqs"] >= r["concurrency"]
    assert {"date", "jax", "backend", "cpu"} <= set(doc["environment"])
    assert doc["machine"]["copy_bandwidth_gb_s"] > 0 and doc["machine"]["matmul_gflop_s"] > 0
    assert plot.stat().st_size > 0 and doc["plot"] == str(plot)


def test_engine_bench_smoke(tmp_path):
    out, plot = tmp_path / "engine.json", tmp_path / "engine.png"
    assert main(["engine", "--quick", "--no-vs-transformers", "--json", str(out), "--plot", str(plot)]) == 0
    doc = json.loads(out.read_text())
    _check_doc(doc, [1, 2], plot)
    assert doc["vs_transformers"] is None
    assert all({"decode", "prefill"} <= set(r["ablation"]) for r in doc["runs"])
    assert closed_loop.ZERO_EXPERTS not in available("moe_matmul")  # registered for the ablated runs only
    assert doc["decode_scaling"]["1k/1k"]["low"] == 1 and doc["decode_scaling"]["1k/1k"]["high"] == 2


@pytest.mark.reference
def test_engine_bench_vs_transformers_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "engine.json"
    # one torch thread: two beside XLA's pool on a busy 2-core machine stalled generate ~100x (0.05 s -> 13 s)
    assert main(["engine", "--quick", "--concurrency", "2", "--vs-transformers", "--threads", "1",
                 "--no-ablate-experts", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    _check_doc(doc, [2], tmp_path / "engine.png")
    vs = doc["vs_transformers"]
    assert vs["requests"] == 2 and vs["dtype"] == "float32" and vs["speedup"] > 0
    assert vs["greedy_match"]["requests_identical"] == 2  # same weights, float32 both: the same greedy tokens
    assert vs["greedy_match"]["first_32_identical"] == 2 and vs["ours"]["precompile"]["buckets"] > 0
