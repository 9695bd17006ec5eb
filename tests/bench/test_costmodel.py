"""`bench costmodel`: its options, the predict timing (a fresh schedule per workload), and the document `run`
assembles from the validations (each stubbed here: they have their own tests), written only with --write-data."""

from __future__ import annotations

import argparse
import json

import pytest

from qwen35_lib import costmodel, data
from qwen35_lib.aot import validate as aot_validate
from qwen35_lib.bench import costmodel as bench
from qwen35_lib.costmodel import cpu_bench, lockstep, validate


def _args(*argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(list(argv))


def test_options_and_their_defaults():
    a = _args()
    assert (a.model, a.write_data) == ("qwen3.5-mini", False)
    assert [s.split(":") for s in a.aot.split(",")] == [["qwen3.5-mini", "4", "2", "64"],
                                                        ["qwen3.5-397b-a17b", "4", "1", "16"]]


def test_predict_speed_times_both_workloads_from_a_fresh_schedule(monkeypatch):
    calls = []
    monkeypatch.setattr(lockstep.lockstep, "cache_clear", lambda: calls.append("clear"))
    monkeypatch.setattr(costmodel, "predict", lambda **kw: calls.append((kw["isl"], kw["osl"], kw["band"])))
    out = bench.predict_speed(64)
    assert list(out) == ["8k/1k", "1k/8k"] and all(v >= 0 for v in out.values())
    assert calls == ["clear", (8192, 1024, True), "clear", (1024, 8192, True)]


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    steps = [dict(case=c, D=1, T=1, measured_s=1.0, predicted_s=r, ratio=r) for c, r in (("a", 0.5), ("b", 2.0),
                                                                                         ("c", 1.0))]
    monkeypatch.setattr(bench, "warn_if_busy", lambda: 0.5)
    monkeypatch.setattr(cpu_bench, "measure", lambda: {"matmul_flops": 1.0})
    monkeypatch.setattr(validate, "cpu_engine_steps", lambda cfg, w, repeats, cpu_specs: steps)
    aot_calls = []

    def aot(name, layers, b, s):
        aot_calls.append((name, layers, b, s))
        return dict(model=name, layers=layers, batch=b, seq=s, error="no libtpu") if layers == 2 else dict(
            model=name, layers=layers, batch=b, seq=s, flops_ratio=1.0, bytes_ratio=1.0, memory_ratio=1.0,
            compile_s=1.0)

    monkeypatch.setattr(aot_validate, "aot_forward_isolated", aot)
    row = dict(source="x/y", isl=1, osl=1, concurrency=1, measured_total_tokens_per_s=1, ratio_fused_ag=1,
               ratio_kernels=1, **{f"ratio_{validate.MEASURED_STAGE}": 1})
    monkeypatch.setattr(validate, "published_comparison", lambda: [row])
    monkeypatch.setattr(validate, "moe_layer_comparison", lambda: [dict(tokens=1, measured_us=1, model_us=1, ratio=1,
                                                                         role="judges")])
    monkeypatch.setattr(bench, "predict_speed", lambda: {"8k/1k": 0.1})
    monkeypatch.setattr(data, "path", lambda name: tmp_path / name)
    monkeypatch.setattr("qwen35_lib.init_weights", lambda cfg, seed: {})
    return aot_calls, tmp_path


def test_run_assembles_the_document_and_writes_only_when_asked(stubbed, capsys):
    aot_calls, tmp = stubbed
    doc = bench.run(_args("--model", "qwen3.5-tiny", "--aot", "qwen3.5-tiny:2:1:8,qwen3.5-mini:4:2:16"))
    assert aot_calls == [("qwen3.5-tiny", 2, 1, 8), ("qwen3.5-mini", 4, 2, 16)]
    assert doc["cpu_ratio_spread"] == [0.5, 2.0] and doc["cpu_ratio_median"] == 1.0
    assert doc["cpu_model"] == "qwen3.5-tiny" and len(doc["aot"]) == 2
    out = capsys.readouterr().out
    assert "AOT qwen3.5-tiny x2: no libtpu" in out  # a failed compile is reported, not tabled
    assert not (tmp / "costmodel_validation.json").exists()
    doc = bench.run(_args("--model", "qwen3.5-tiny", "--aot", "", "--write-data"))
    assert doc["aot"] == []
    written = json.loads((tmp / "costmodel_validation.json").read_text())
    assert written["benchmark"] == "costmodel" and written["cpu_ratio_median"] == 1.0
