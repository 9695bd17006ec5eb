"""`bench mtp`'s engine runs: the two engines timed over the same prompts beside the cost model's CPU prediction on
the specs measured between them, and each program alone beside its price."""

from __future__ import annotations

import numpy as np

from qwen35_lib.bench import mtp_engine
from qwen35_lib.bench.mtp import synthetic_prompts
from qwen35_lib.costmodel import cpu_bench
from qwen35_lib.weights import init_mtp_weights


def test_the_engine_is_timed_with_and_without_drafts_beside_the_cost_models_cpu_prediction(tiny, monkeypatch):
    """The only check of the measured comparison `bench mtp` prints: two engines over the same prompts, the same
    greedy outputs, the engine's own acceptance count, nothing compiled while timed, the CPU's specs measured
    before each round; the cost model's CPU prediction for the same run on them; each program alone (the same
    compiled programs, so no compile here) beside its price. (Precompiling is skipped: the untimed warm-up run
    compiles what the timed one steps with.)"""
    from qwen35_lib.engine import Engine

    monkeypatch.setattr(Engine, "precompile", lambda self, *a, **k: {})
    rounds, measured = [], cpu_bench.measure(1)
    monkeypatch.setattr(cpu_bench, "measure_now", lambda *a: rounds.append(1) or measured)
    cfg, w = tiny
    head = init_mtp_weights(cfg, 1)
    prompts = synthetic_prompts(1, 4, cfg.vocab_size, 0)
    e = mtp_engine.engine_speculation(cfg, w, head, prompts, 3, 1, max_num_seqs=1, repeats=2)
    assert e["same_outputs"] and e["0"]["output_tokens"] == e["1"]["output_tokens"] == 3
    assert len(e["1"]["wall_s_each"]) == 2 and e["1"]["wall_s"] == np.median(e["1"]["wall_s_each"])
    assert e["1"]["drafted"] > 0 and 1 <= e["acceptance_length"] <= 2 and e["speedup"] > 0
    assert e["0"]["traces_while_timed"] == e["1"]["traces_while_timed"] == 0  # precompiled
    assert len(rounds) == 2 and e["cpu_specs"] == measured  # one measurement a round, their median
    c = mtp_engine.cpu_prediction(cfg, e)
    assert set(c["output_tokens_per_s"]) == {"0", "1"} and c["speedup"] > 0
    steps = mtp_engine.step_ratios(cfg, w, head, prompts, 3, 1, max_num_seqs=1, repeats=2, cpu_specs=e["cpu_specs"])
    assert set(steps) == {"decode", "verify", "draft"}
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 and r["tokens"] >= 1 for r in steps.values())
    assert steps["verify"]["tokens"] >= 2  # a decode row of 1 + k tokens
