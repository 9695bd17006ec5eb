"""Smoke tests of the benchmark scripts: each runs end to end at a tiny size and writes valid JSON.

No timing assertions (benchmarks measure, they do not judge); only structure, and that the compared outputs agree.
"""

import json

import pytest

from qwen35_lib.bench import BENCHMARKS, load
from qwen35_lib.bench.__main__ import HUGE_PAGES, huge_pages_env, main
from qwen35_lib.bench.timing import environment, measure
from qwen35_lib.bench.vs_transformers import parse_shapes


def test_every_benchmark_module_has_the_protocol():
    for name in BENCHMARKS:
        module = load(name)
        assert module.DESCRIPTION and callable(module.add_arguments) and callable(module.run), name


def test_unknown_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-benchmark"])
    assert e.value.code == 2
    assert "vs-transformers" in capsys.readouterr().err  # argparse lists the choices


def test_huge_pages_env_only_where_it_applies():
    madvise = "always [madvise] never\n"
    env = huge_pages_env({"PATH": "/bin"}, ("glibc", "2.36"), madvise)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": HUGE_PAGES}
    kept = huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, ("glibc", "2.36"), madvise)
    assert kept["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGES}"
    for environ, libc, thp in [({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, ("glibc", "2.36"), madvise),  # set
                               ({"QWEN35_HUGEPAGES": "0"}, ("glibc", "2.36"), madvise),  # turned off
                               ({}, ("glibc", "2.31"), madvise), ({}, ("", ""), madvise),  # old glibc, musl
                               ({}, ("glibc", "2.36"), "[always] madvise never"), ({}, ("glibc", "2.36"), None)]:
        assert huge_pages_env(environ, libc, thp) is None, (environ, libc, thp)


def test_measure_interleaves_and_keeps_warmup_outputs():
    calls = []
    candidates = {"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}
    timings, outputs = measure(candidates, repeats=3, settle=0)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then rounds in rotated order
    calls.clear()
    measure(candidates, repeats=2, settle=1)
    assert calls == ["a", "b", "a", "a", "b", "b", "b", "b", "a", "a"]  # each timed call right after its twin
    assert outputs == {"a": 1, "b": 2}
    assert len(timings["a"].times) == 3 and timings["a"].median >= 0
    assert {"date", "jax", "backend", "cpu", "cores"} <= set(environment())


def test_parse_shapes():
    assert parse_shapes("1x512, 4X256") == [(1, 512), (4, 256)]
    for bad in ("", "512", "1x0", "axb"):
        with pytest.raises(ValueError):
            parse_shapes(bad)


def test_kernels_smoke(tmp_path):
    out, choice = tmp_path / "kernels.json", tmp_path / "choice.json"
    assert main(["kernels", "--model", "qwen3.5-tiny", "--tokens", "8", "--dtypes", "float32", "--repeats", "1",
                 "--tile-sweep", "16", "--gdn-prefill-tokens", "70", "--gdn-decode-batch", "2",
                 "--json", str(out), "--write-choice", str(choice)]) == 0
    doc = json.loads(out.read_text())
    assert {"cases", "implementations", "wins", "overall", "environment"} <= set(doc)
    case = doc["cases"][0]
    assert case["tokens"] == 8 and case["dtype"] == "float32" and case["winner"] in doc["implementations"]
    assert set(case["median_ms"]) == set(doc["implementations"]) | {"tiled m=16", "dense (all experts)",
                                                                     "dense matmul (equal FLOPs)"}
    assert max(case["max_abs_diff_vs_ragged_dot"].values()) < 1e-5  # every candidate computes the same thing
    assert json.loads(choice.read_text())["overall"] == doc["overall"]
    # off a TPU the Pallas kernels are checked in interpret mode, never timed; every timed one has a ratio
    assert "pallas" not in doc["implementations"] and doc["numerics_only"] == ["pallas", "megablox gmm"]
    assert set(doc["throughput_ratio_vs_dense"]) == set(doc["implementations"]) | {"tiled m=16"}
    assert doc["default_implementation"] in doc["implementations"] and doc["acceptance"]["tokens"] == 8
    # the attention and GDN sections: Pallas next to its XLA twin, labelled interpret mode, computing the same
    for slot in ("attention", "gdn"):
        rows = doc[slot]["rows"]
        assert rows and {r["implementation"] for r in rows} == {"xla", "pallas"}, slot
        for r in rows:
            assert r["median_ms"] > 0 and (r["implementation"] == "xla" or "interpret" in r["mode"]), r
            assert r["max_abs_diff_vs_xla"] < 2e-2, r  # bf16 (the tiny model's dtype): one rounding of O(1) outputs


@pytest.mark.reference
def test_vs_transformers_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "vs.json"
    assert main(["vs-transformers", "--model", "qwen3.5-tiny", "--shapes", "1x16", "--repeats", "1",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["dtype"] == "float32" and doc["model"] == "qwen3.5-tiny"
    (shape,) = doc["shapes"]
    assert (shape["batch"], shape["seq"], shape["tokens"]) == (1, 16, 16)
    assert set(shape["tokens_per_s"]) == {"ours", "transformers"} and shape["speedup"] > 0
    assert shape["max_abs_logit_diff"] < 1e-4  # the same weights give the same logits
    assert doc["matmul_gflop_s"] > 0 and shape["matmul_roofline"]["flops"] > 0
    assert shape["matmul_roofline"]["ours"] > 0 and shape["matmul_roofline"]["transformers"] > 0
    rows = {r["component"]: r for r in shape["profile"]["rows"]}  # our forward, profiled, beside its floors
    assert rows["dense matmuls"]["ms"] > 0 and rows["dense matmuls"]["flops_ms"] > 0 and rows["MoE"]["floor_ms"] > 0
    assert "withhold_ratios" in doc["load"] and doc["ratios_withheld"] == doc["load"]["withhold_ratios"]
