"""`predict --layout auto` and `costmodel layouts` (issue 55, item 3): every candidate layout priced, the best served,
the runner-up and the margin named; the choice is the prices' (the highest total tokens/s of those that fit)."""

from __future__ import annotations

import json

import pytest

from qwen35_lib.costmodel import choice, predict
from qwen35_lib.costmodel.__main__ import main


def test_candidates_take_the_flags_where_a_layout_has_them():
    plans = {p.layout: p for p in choice.candidates("replicate", True, True, "pallas")}
    assert list(plans) == list(choice.CANDIDATES)
    assert plans["tp8_kvrep"].routing is None and not plans["tp8_kvrep"].fuse_allgather
    assert plans["tp8_ep8"].routing == "replicate" and not plans["tp8_ep8"].fuse_allgather  # nothing to fuse
    assert plans["dp8_ep8"].fuse_allgather and plans["dp8_ep8"].hierarchical_rs
    assert all(p.kernels == "pallas" for p in plans.values())
    a2a = {p.layout: p for p in choice.candidates("all_to_all", True, False)}
    assert a2a["dp8_ep8"].routing == "all_to_all" and not a2a["dp8_ep8"].fuse_allgather
    # priced as tpu-inference's engine: named as the plan the cost model prices so, the top-k packed under DP
    ti = {p.layout: p for p in choice.candidates(kernels="pallas", engine="tpu-inference")}
    assert {p.name for p in ti.values()} == {"tpu_inference_3050"}
    assert ti["dp4_tp2_ep8"].fuse_allgather and not ti["tp8_ep8"].fuse_allgather


def test_auto_serves_the_best_priced_layout_and_names_the_runner_up():
    doc = choice.choose(isl=8192, osl=1024, concurrency=4, kernels="pallas", roofline=False)
    c = doc["layout_choice"]
    fit = [r for r in c["candidates"] if r["fits"]]
    assert {r["layout"] for r in c["candidates"]} == set(choice.CANDIDATES)
    best = max(fit, key=lambda r: r["total_tokens_per_s"])
    assert c["picked"] == best["layout"] == doc["layout"] and [r["layout"] for r in fit][:2] == [c["picked"],
                                                                                                c["runner_up"]]
    assert c["margin"] == pytest.approx(fit[0]["total_tokens_per_s"] / fit[1]["total_tokens_per_s"] - 1)
    # the served document is the picked layout's own prediction
    alone = predict(stage=choice.candidates(kernels="pallas")[choice.CANDIDATES.index(c["picked"])], isl=8192,
                    osl=1024, concurrency=4, roofline=False)
    assert doc["total_tokens_per_s"] == pytest.approx(alone["total_tokens_per_s"]) == best["total_tokens_per_s"]


def test_cli_auto_json_and_layouts_table(capsys):
    assert main(["predict", "--layout", "auto", "--kernels", "pallas", "--isl", "1024", "--osl", "1024",
                 "--concurrency", "8", "--no-band", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == doc["layout_choice"]["picked"] and doc["layout_choice"]["runner_up"] is not None
    assert main(["layouts", "--isl", "1024", "--osl", "1024", "--concurrencies", "2,8", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in t["rows"]] == [2, 8]
    for row in t["rows"]:
        fit = [c for c in row["candidates"] if c["fits"]]
        assert row["picked"] == max(fit, key=lambda c: c["total_tokens_per_s"])["layout"]
    assert main(["layouts", "--isl", "1024", "--osl", "1024", "--concurrencies", "2"]) == 0
    text = capsys.readouterr().out
    assert "best" in text and "margin" in text and all(name in text for name in choice.CANDIDATES)


def test_no_async_scheduling_puts_the_host_turnaround_on_every_step(capsys):
    """`--no-async-scheduling` (issue 55, item 6): tpu-recipes' Qwen3.5 runs leave vLLM's async scheduling off."""
    args = ["predict", "--stage", "kernels", "--isl", "1024", "--osl", "1024", "--concurrency", "8", "--no-band",
            "--json"]
    assert main(args) == 0
    on = json.loads(capsys.readouterr().out)
    assert main([*args, "--no-async-scheduling"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert on["mechanisms"]["async_scheduling"] and not off["mechanisms"]["async_scheduling"]
    assert off["breakdown_s"]["host"] == pytest.approx(off["mechanisms"]["host_step_time_sync_s"])
    assert off["total_tokens_per_s"] < on["total_tokens_per_s"]


def test_the_published_dp4tp2_row_is_predicted_as_its_layout():
    """`validate --layouts`: tpu-inference #3050's DP4TP2_EP row (8k/1k, c32) priced as that engine runs dp4_tp2_ep8."""
    from qwen35_lib.costmodel import validate

    rows = validate.layout_points()
    row = next(r for r in rows if r["layout"] == "dp4_tp2_ep8")
    assert (row["isl"], row["osl"], row["concurrency"]) == (8192, 1024, 32)
    assert row["ratio"] == pytest.approx(row["predicted_total_tokens_per_s"] / row["measured_total_tokens_per_s"])
    assert 0 < row["ratio"] < 10 and 0 < row["tpot_ratio"] < 10


def test_layout_mechanisms_split_each_layouts_time_per_token():
    """`choice.layout_mechanisms` (notebook 02's layouts section): each layout's ms per 1,000 tokens split by the
    mechanism that separates the layouts, the parts adding up to one over the throughput; at 4 requests every
    data-parallel rank reads its own copy of the dense weights, so dp8_ep8 spends more on them than tp8_ep8."""
    rows = choice.layout_mechanisms(concurrency=4, layouts=("tp8_ep8", "dp8_ep8"))
    assert set(rows) == {"tp8_ep8", "dp8_ep8"}
    for parts in rows.values():
        assert set(parts) == {*choice.MECHANISMS, "other", "total"}
        assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"])
    assert rows["dp8_ep8"]["dense weights"] > rows["tp8_ep8"]["dense weights"]


def test_the_published_tp8_ep_rows_are_predicted_under_their_own_setup():
    """#3116's TP8_EP rows (c4, c8) carry their server.sh setup (DP 1: batched tokens capped at 2048, CONC x 2
    sequences): `validate --layouts` prices them under it; #3050's DP4TP2_EP rows under their PR's rules (ISL / DP)."""
    from qwen35_lib.costmodel import validate

    rows = validate.layout_points()
    tp = [r for r in rows if r["layout"] == "tp8_ep8"]
    assert sorted((r["isl"], r["concurrency"]) for r in tp) == [(1024, 4), (1024, 8), (8192, 4), (8192, 8)]
    assert all(r["max_batched_tokens_per_rank"] == 2048 for r in tp)
    assert all(r["max_batched_tokens_per_rank"] == r["isl"] // 4 for r in rows if r["layout"] == "dp4_tp2_ep8")


def test_tpu_inference_setup_is_the_settings_recipe_emits():
    """Priced as tpu-inference's engine, each candidate is set as that engine's Qwen3.5 sweep set it (server.sh at
    the commit of its SHARDING_TABLE: the settings `recipe` emits for the layout), at its own DP size."""
    from qwen35_lib import recipe
    from qwen35_lib.costmodel.predict import token_budget

    for isl, conc in ((8192, 4), (8192, 64), (1024, 512)):
        for dp in (1, 4, 8):
            d = recipe.derived(isl, 1024, conc, dp)
            assert choice.tpu_inference_setup(isl, conc, dp) == dict(max_batched_tokens=d["max_num_batched_tokens"],
                                                                     max_seqs=d["max_num_seqs"])
    t = choice.table(isl=8192, osl=1024, concurrencies=(64,), kernels="pallas", engine="tpu-inference",
                     layouts=("tp8_ep8", "dp4_tp2_ep8", "dp8_ep8"))
    assert t["setup"] == "tpu-inference"
    got = {c["layout"]: (c["max_batched_tokens_per_rank"], c["max_seqs_per_rank"]) for c in t["rows"][0]["candidates"]}
    assert got == {"tp8_ep8": (2048, 128), "dp4_tp2_ep8": (2048, 32), "dp8_ep8": (1024, 16)}
    # the library's own settings on request; a budget the caller gives is every candidate's
    lib = choice.table(isl=8192, osl=1024, concurrencies=(64,), kernels="pallas", engine="tpu-inference",
                       setup="library", layouts=("tp8_ep8", "dp8_ep8"))
    assert {c["layout"]: c["max_batched_tokens_per_rank"] for c in lib["rows"][0]["candidates"]} == {
        "tp8_ep8": token_budget(8192, 1), "dp8_ep8": token_budget(8192, 8)}
    given = choice.choose(isl=8192, osl=1024, concurrency=8, kernels="pallas", engine="tpu-inference",
                          layouts=("tp8_ep8", "dp8_ep8"), max_batched_tokens=512, roofline=False)
    assert given["max_batched_tokens_per_rank"] == 512 and given["layout_choice"]["setup"] == "tpu-inference"
    with pytest.raises(ValueError, match="unknown setup"):
        choice.resolve_setup("sweep", "this")
