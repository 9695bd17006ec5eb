"""qwen35_lib.stage_gain: what a stage buys over the one before it, the figures chapters 01-05 open with."""

from __future__ import annotations

import pytest

from qwen35_lib.plan import LADDER
from qwen35_lib.stage_gain import GROUPS, WORKLOADS, gain_table, ms_per_1k_tokens, previous_stage, stage_gain

CONCURRENCY = 64


@pytest.fixture(scope="module")
def made() -> dict:
    return {}


@pytest.fixture(scope="module")
def replicate(made: dict) -> dict:
    # the record's arithmetic does not depend on the load: 64 requests (8 a rank) play a tenth of the schedule
    # the chapters' 512 do (their figures are checked where they are printed)
    return stage_gain("replicate", concurrency=CONCURRENCY, predictions=made)


def test_previous_stage_follows_the_ladder() -> None:
    assert previous_stage(LADDER[0]) is None
    assert [previous_stage(s) for s in LADDER[1:]] == list(LADDER[:-1])
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        previous_stage("nope")


def test_the_groups_cover_every_component_once(made: dict, replicate: dict) -> None:
    parts = [c for cs in GROUPS.values() for c in cs]
    assert len(parts) == len(set(parts))
    assert set(made["replicate", "8k/1k"]["breakdown_fraction"]) <= set(parts)


def test_record_is_the_two_predictions(made: dict, replicate: dict) -> None:
    assert replicate["previous"] == "dp_ep" and set(made) == {(s, w) for s in ("dp_ep", "replicate") for w in WORKLOADS}
    for wl in WORKLOADS:
        before, after, row = made["dp_ep", wl], made["replicate", wl], replicate[wl]
        assert row["gain"] == after["total_tokens_per_s"] / before["total_tokens_per_s"]
        assert row["change"] == pytest.approx(row["gain"] - 1)
        # the groups sum to the time per token: 1 / throughput, in ms per 1,000 tokens
        assert sum(row["ms_per_1k_tokens"].values()) == pytest.approx(1e6 / after["total_tokens_per_s"], rel=1e-9)
        assert sum(row["previous_ms_per_1k_tokens"].values()) == pytest.approx(1e6 / before["total_tokens_per_s"],
                                                                                rel=1e-9)
        for g in GROUPS:
            assert row["saved_ms_per_1k_tokens"][g] == pytest.approx(
                row["previous_ms_per_1k_tokens"][g] - row["ms_per_1k_tokens"][g])
    assert "replicate at 8k/1k" in gain_table(replicate) and "over dp_ep" in gain_table(replicate)


def test_given_predictions_are_reused_not_remade(made: dict, replicate: dict) -> None:
    fake = {k: dict(v) for k, v in made.items()}
    for wl in WORKLOADS:
        fake["replicate", wl]["total_tokens_per_s"] *= 2
    doubled = stage_gain("replicate", concurrency=CONCURRENCY, predictions=fake)
    for wl in WORKLOADS:
        assert doubled[wl]["gain"] == pytest.approx(2 * replicate[wl]["gain"])


def test_a_stage_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit \\(no room\\)"):
        ms_per_1k_tokens({"fits": False, "stage": "baseline", "reason": "no room"})


def test_baseline_record_has_no_previous(made: dict, replicate: dict) -> None:  # replicate: fills `made`
    rec = stage_gain("baseline", concurrency=CONCURRENCY, band=False,  # made["dp_ep", *]: no band (the previous)
                     predictions={("baseline", wl): made["dp_ep", wl] for wl in WORKLOADS})
    assert rec["previous"] is None
    assert all("gain" not in rec[wl] and set(rec[wl]["ms_per_1k_tokens"]) == set(GROUPS) for wl in WORKLOADS)


def test_each_stage_carries_its_band(replicate: dict) -> None:
    for wl in WORKLOADS:
        lo, hi = replicate[wl]["band_total_tokens_per_s"]
        assert lo <= replicate[wl]["total_tokens_per_s"] <= hi and lo < hi
    assert "(band " in gain_table(replicate)


def test_only_the_stage_itself_carries_the_band(made: dict, replicate: dict) -> None:
    for wl in WORKLOADS:
        assert "band" in made["replicate", wl] and "band_total_tokens_per_s" in replicate[wl]
        assert "band" not in made["dp_ep", wl]  # the previous stage: throughput and breakdown only
    mine = dict(made)
    dp_ep = stage_gain("dp_ep", concurrency=CONCURRENCY, predictions=mine)  # now the stage: its band is made
    for wl in WORKLOADS:
        assert "band" in mine["dp_ep", wl] and dp_ep[wl]["band_total_tokens_per_s"] == \
            mine["dp_ep", wl]["band"]["total_tokens_per_s"]
        assert mine["dp_ep", wl]["total_tokens_per_s"] == made["dp_ep", wl]["total_tokens_per_s"]
