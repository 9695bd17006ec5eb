"""The arithmetic placement report against real shards (CPU size) and hand-checked 397B cases."""

from __future__ import annotations

import jax
import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from qwen35_lib import budget  # noqa: E402
from qwen35_lib.config import get_config  # noqa: E402
from qwen35_lib.engine.cache import cache_shardings, init_cache  # noqa: E402
from qwen35_lib.parallel import placed_config, shard_weights  # noqa: E402
from qwen35_lib.placement import fmt_range, placement, shard_bytes_per_device  # noqa: E402
from qwen35_lib.plan import LAYOUTS, get_layout, make_mesh  # noqa: E402
from qwen35_lib.weights import declare, init_weights, is_info  # noqa: E402

BIG = get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn")


def _bytes_on(tree, device) -> int:
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device)


@pytest.mark.parametrize("expert_dtype", [None, "float8_e4m3fn"])
def test_weight_and_cache_bytes_equal_real_shards(expert_dtype):
    """At CPU size, on 8 simulated devices: bytes per device from the arithmetic = bytes of the real shards."""
    mesh, dev0 = make_mesh(), jax.devices()[0]
    tiny = get_config("qwen3.5-tiny", dtype="float32", expert_dtype=expert_dtype)
    if expert_dtype is None:  # random weights; the layout does not change them, so one init (one compile) serves all
        values = init_weights(tiny)
    else:  # FP8 pairs: only shapes and dtypes matter for bytes, so zeros (no second init compile)
        values = jax.tree.map(lambda i: np.zeros(i.shape, i.dtype), declare(tiny), is_leaf=is_info)
    valid = []
    for layout in LAYOUTS:
        cfg = tiny
        p = placement(cfg, layout, requests=5, context_len=40, page_size=8)
        if p.problem:
            continue
        valid.append(layout)
        plan = get_layout(layout).bind(mesh, cfg)
        weights = shard_weights(cfg, plan, values, mesh)
        assert _bytes_on(weights, dev0) == p.weight_bytes_per_device, layout
        cache = jax.device_put(init_cache(cfg, p.cache_shape), cache_shardings(cfg, plan, p.cache_shape, mesh))
        assert _bytes_on(cache, dev0) == p.kv_bytes_per_device + p.gdn_state_bytes_per_device, layout
        assert shard_bytes_per_device(cache["kv"], mesh) == [p.kv_bytes_per_device] * 8, layout  # every device
    # tp8 and tp: 2 KV heads do not divide 8
    assert valid == ["single", "tp8_kvrep", "tp8_ep8", "dp4_tp2_ep8", "dp8_ep8", "tp_kvrep", "tp_ep", "dp_tp2_ep",
                     "dp_ep"]


def test_dp8_ep8_397b():
    p = placement(BIG, "dp8_ep8")
    assert p.problem is None and p.ranks == 8
    for d, dev in enumerate(p.per_device):
        assert dev.holds["experts"] == range(64 * d, 64 * d + 64)  # 512 / 8 = 64 experts per device
        assert dev.holds["kv_heads"] == range(2) and dev.holds["q_heads"] == range(32)  # attention whole
        assert len(dev.holds["requests"]) == 64
    assert fmt_range(p.per_device[0].holds["experts"]) == "0-63"
    # everything but the routed experts replicated, the experts split 8 ways: budget's `experts_sharded`
    assert p.weight_bytes_per_device == budget.weight_bytes_per_device(BIG, 8, "experts_sharded")
    assert p.hbm_bytes_per_device == 96 * 2**30


def test_tp8_refused_with_the_fix():
    p = placement(BIG, "tp8")
    assert p.problem and "tp8_kvrep" in p.problem and "dp8_ep8" in p.problem
    assert "2 KV heads" in p.problem and p.why and not p.fits
    assert any(r.startswith("kv_heads: 2/4 do not divide 8") for r in p.replicated)


def test_tp8_kvrep_keeps_one_kv_head_per_device_4x():
    # tp8_kvrep duplicates each of the 2 KV heads 4x in the weights (vLLM's convention): device d keeps copy d, a
    # copy of head d // 4, the one its 4 query heads read. The requests are not split (one data-parallel rank),
    # so each device holds 1 KV head of all 512 requests; dp8_ep8 holds both heads of its own 64. Per device:
    # 512 / 64 / 2 = 4x. Not exactly 4x: each rank has one null page, 1 in tp8_kvrep's pool vs 1 per 64 requests.
    rep, dp = placement(BIG, "tp8_kvrep"), placement(BIG, "dp8_ep8")
    assert rep.problem is None and rep.ranks == 1
    assert [d.holds["kv_heads"] for d in rep.per_device] == [range(h, h + 1) for h in (0, 0, 0, 0, 1, 1, 1, 1)]
    pages = -(-8192 // 16)
    assert rep.kv_bytes_per_device / dp.kv_bytes_per_device == pytest.approx((512 * pages + 1) / (64 * pages + 1) / 2)
    assert rep.kv_bytes_per_device / dp.kv_bytes_per_device == pytest.approx(4, rel=1e-4)
    assert rep.copies["kv"] == 4 and dp.copies["kv"] == 1
    assert rep.sizes["kv_heads"] == 2


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_tp_kvrep_kv_shard_holds_max_1_hkv_over_tp_heads(devices):
    """16 query / 2 KV heads split over 2, 4, 8 devices: max(1, 2 / tp) KV heads per device, in the placed cache
    shard, the arithmetic and the cost model alike."""
    from qwen35_lib.costmodel import ops
    cfg = get_config("qwen3.5-tiny", dtype="float32", num_q_heads=16, num_kv_heads=2)
    mesh = make_mesh(jax.devices()[:devices])
    plan = get_layout("tp_kvrep").bind(mesh, cfg)
    placed = placed_config(cfg, plan, mesh)
    want = max(1, 2 // devices)
    p = placement(cfg, "tp_kvrep", devices=devices, requests=3, context_len=32, page_size=8)
    shape = p.cache_shape
    abstract = jax.eval_shape(lambda: init_cache(placed, shape))
    kv = abstract["kv"]
    shard = cache_shardings(placed, plan, shape, mesh)["kv"].shard_shape(kv.shape)
    assert shard[-1] == want * 2 * cfg.head_dim  # K and V of `want` heads
    assert p.kv_bytes_per_device == kv.dtype.itemsize * np.prod(shard)
    assert plan.kv_heads_per_device(cfg) == ops.kv_heads_per_device(cfg, devices) == want


def test_dp4_tp2_ep8_heads_over_core_requests_over_chip():
    p = placement(BIG, "dp4_tp2_ep8", requests=9)
    d0, d1, d2 = p.per_device[:3]
    assert (d0.holds["kv_heads"], d1.holds["kv_heads"]) == (range(0, 1), range(1, 2))
    assert d0.holds["requests"] == d1.holds["requests"] == range(0, 9, 4) and d2.holds["requests"] == range(1, 9, 4)
    assert p.copies["kv"] == 1 and p.cache_shape.num_slots == 4  # ceil(9 / 4) = 3 requests per rank + null slot


def test_the_placements_pools_are_for_requests():
    # `placement`'s caches are `CacheShape.for_requests` (each rank's sequences' whole contexts + the null page, a
    # slot each + the null slot), the KV dtype the model's when none is asked: the same pools as the compiles
    from qwen35_lib.engine.cache import CacheShape

    for layout, ranks in (("dp8_ep8", 8), ("dp4_tp2_ep8", 4), ("tp8_kvrep", 1)):
        p = placement(BIG, layout, requests=10, context_len=40, page_size=16)
        assert p.ranks == ranks and p.cache_shape == CacheShape.for_requests(
            10, 40, ranks=ranks, page_size=16, kv_dtype=BIG.dtype), layout
    fp8 = placement(BIG, "dp8_ep8", kv_dtype="float8_e4m3fn", requests=10, context_len=40, page_size=16)
    assert fp8.cache_shape == CacheShape.for_requests(10, 40, ranks=8, page_size=16, kv_dtype="float8_e4m3fn")
