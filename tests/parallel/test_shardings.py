"""Shardings (a layout applied): which dims a PartitionSpec splits, the configs and weights tp_kvrep places
(duplicated KV heads), the placed weights keeping their values, and the leaf listing."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from qwen35_lib import get_config
from qwen35_lib.parallel.shardings import (
    batch_sharding,
    duplicate_kv_heads,
    leaf_infos,
    placed_config,
    shard_weights,
    spec,
    weight_shardings,
)
from qwen35_lib.plan import ALL, SINGLE, get_layout
from qwen35_lib.weights import declare, is_info

CFG8 = get_config("qwen3.5-tiny", dtype="float32", num_q_heads=8)  # 4 query heads per KV head: tp8_kvrep copies 4x


def test_a_dim_splits_only_when_it_divides_and_its_axes_are_free(mesh):
    dp_ep = get_layout("dp_ep").bind(mesh)
    assert spec(dp_ep, mesh, ("experts", "embed"), (8, 64)) == P(ALL, None)
    assert spec(dp_ep, mesh, ("experts", "embed"), (12, 64)) == P(None, None)  # 12 experts over 8: kept whole
    assert spec(dp_ep, mesh, ("batch", "experts"), (8, 8)) == P(ALL, None)  # both axes spent on the first dim
    mixed = get_layout("dp4_tp2_ep8").bind(mesh)  # batch over chip (4), heads over core (2)
    assert spec(mixed, mesh, ("batch", "q_heads", None), (4, 6, 3)) == P("chip", "core", None)
    assert spec(mixed, mesh, ("batch", "q_heads"), (6, 3)) == P(None, None)
    assert spec(mixed, mesh, (None, "unknown"), (8, 8)) == P(None, None)


def test_placed_config_duplicates_kv_heads_under_tp_kvrep_only(mesh):
    kvrep = get_layout("tp8_kvrep").bind(mesh, CFG8)
    assert placed_config(CFG8, kvrep).num_kv_heads == 8  # 2 heads x 4 copies: one per device
    assert placed_config(CFG8, get_layout("dp8_ep8").bind(mesh, CFG8)) == CFG8
    assert placed_config(CFG8, SINGLE.bind(None)) is CFG8
    assert placed_config(CFG8, SINGLE.replace(gdn_state_dtype="bfloat16").bind(None)).gdn_state_dtype == "bfloat16"


def test_duplicated_kv_heads_keep_each_query_heads_head(mesh):
    kvrep = get_layout("tp8_kvrep").bind(mesh, CFG8)
    rng = np.random.default_rng(0)
    w = jax.tree.map(lambda i: rng.standard_normal(i.shape).astype(np.float32), declare(CFG8), is_leaf=is_info)
    out = duplicate_kv_heads(CFG8, kvrep, w, mesh)
    for name in ("w_k", "w_v"):  # [G, Na, D, Hkv, d]: copy c is head c // 4, so query head q (of 8) still reads
        a, b = w["layers"]["attn"][name], np.asarray(out["layers"]["attn"][name])  # KV head q // 4
        assert b.shape[3] == 8
        for copy in range(8):
            np.testing.assert_array_equal(b[:, :, :, copy], a[:, :, :, copy // 4])
    assert out["layers"]["attn"]["w_q"] is w["layers"]["attn"]["w_q"]  # no KV-head axis: untouched
    again = duplicate_kv_heads(CFG8, kvrep, out, mesh)
    assert again["layers"]["attn"]["w_k"].shape == out["layers"]["attn"]["w_k"].shape  # already placed: kept


@pytest.mark.parametrize("layout", ["dp8_ep8", "tp8_kvrep"])
def test_placed_weights_keep_their_values_and_follow_the_layout(tiny, mesh, layout):
    cfg, w = tiny
    plan = get_layout(layout).bind(mesh, cfg)
    placed = shard_weights(cfg, plan, w, mesh)
    shard = weight_shardings(cfg, plan, mesh)
    for (path, a), b, s in zip(jax.tree_util.tree_leaves_with_path(w), jax.tree.leaves(placed),
                               jax.tree.leaves(shard)):
        assert b.sharding.is_equivalent_to(s, b.ndim), jax.tree_util.keystr(path)
        if b.shape == a.shape:
            np.testing.assert_array_equal(b, a)
    experts = placed["layers"]["moe"]["w_gate_up"].sharding.spec
    assert experts[2] == (ALL if layout == "dp8_ep8" else None)
    assert (placed["lm_head"].sharding.spec[1] == ALL) == (layout == "tp8_kvrep")  # vocab split under TP only


def test_batch_sharding_splits_ranks_over_the_batch_axes(mesh):
    sh = batch_sharding(get_layout("dp4_tp2_ep8").bind(mesh), mesh, 3)
    assert sh.spec == P("chip", None, None)


def test_leaf_infos_list_every_weight_with_fp8_pairs_flattened():
    cfg = get_config("qwen3.5-tiny")
    infos = dict(leaf_infos(cfg))
    assert len(infos) == len(jax.tree.leaves(declare(cfg), is_leaf=is_info))
    assert infos["['layers']['moe']['w_down']"].logical_axes == (None, None, "experts", "moe_ffn", "embed")
    fp8 = dict(leaf_infos(cfg.replace(expert_dtype="float8_e4m3fn", fp8_block_size=16)))
    assert len(fp8) == len(infos) + 2  # w_gate_up and w_down: value and scale each
    assert {k for k in fp8 if "w_down" in k} == {"['layers']['moe']['w_down'].value",
                                                  "['layers']['moe']['w_down'].scale"}
