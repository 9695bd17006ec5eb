"""costmodel.collectives on a made-up ring (`toy`): all-gather, all-to-all and the hierarchical reduce-scatter
against hand arithmetic."""

from __future__ import annotations

import pytest

from qwen35_lib.costmodel import collectives as cc
from tests.costmodel.toy import GB, toy


def test_all_gather_on_a_ring():
    s = toy(chips=4)
    B = 8e6  # each of 4 devices holds 8 MB; each receives 3 shards, half over each direction of its ring link
    got = cc.all_gather(s, B)
    assert got.seconds == pytest.approx(5e-6 + 3 * 1e-6 + 3 * B / (2 * 100 * GB))  # 128 us
    assert got.wire_bytes == 3 * B
    assert cc.reduce_scatter(s, 4 * B).seconds == pytest.approx(got.seconds)  # RS of 4B = AG of B, backwards
    assert cc.all_reduce(s, 4 * B).seconds == pytest.approx(2 * got.seconds)
    sw = toy(chips=4, ring="switch")  # behind a switch: 3 shards through one link, one hop
    assert cc.all_gather(sw, B).seconds == pytest.approx(5e-6 + 1e-6 + 3 * B / (100 * GB))
    assert cc.all_gather(toy(chips=1), B).seconds == 0.0


def test_all_to_all_on_a_ring():
    assert cc.ring_hops_sum(8) == 1 + 2 + 3 + 4 + 3 + 2 + 1
    assert cc.ring_hops_sum(4) == 1 + 2 + 1
    s = toy(chips=8)
    X = 16e6  # each device sends 2 MB to each of 8 devices; 16 link-hops of 2 MB over 16 directed links each
    assert cc.all_to_all(s, X).seconds == pytest.approx(5e-6 + 4 * 1e-6 + X * 16 / 16 / (100 * GB))


def test_hierarchical_reduce_scatter_on_2x4():
    s = toy(chips=4, cores=2)  # 8 devices: 4 chips x 2 cores; core link 400 GB/s, ring link 100 GB/s
    X = 64e6
    t1 = (X / 2) / (400 * GB) + 1e-6  # phase 1: 32 MB to the sibling core: 81 us
    t2 = 2 * 3 * (X / 2 / 4) / 2 / (100 * GB) + 3 * 1e-6  # phase 2: 2 cores x 3 steps of 8 MB, half each way: 243 us
    assert t1 == pytest.approx(81e-6) and t2 == pytest.approx(243e-6)
    assert cc.hierarchical_reduce_scatter(s, X, 1, overlap=False).seconds == pytest.approx(5e-6 + t1 + t2)
    assert cc.hierarchical_reduce_scatter(s, X, 4).seconds == pytest.approx(5e-6 + t2 + t1 / 4)
    flat = cc.reduce_scatter(s, X)  # one ring through all 8 devices, each step at the slower (ICI) link
    assert flat.seconds == pytest.approx(5e-6 + 7 * 1e-6 + 7 * (X / 8) / (2 * 100 * GB))  # 292 us
    assert cc.hierarchical_reduce_scatter(s, X, 4).seconds < flat.seconds
    assert cc.hierrs_micro_batches(100) == 1 and cc.hierrs_micro_batches(4096) == 8
