"""The CPU fast paths against the paths they replace: the unrolled layer loop (per-layer weight leaves) vs the
scan, the all-greedy sampling branch vs the sorted one, padding tokens routed to no expert,
`Engine.precompile` (a run after it compiles nothing), and the expert-loop MoE (`moe_loop`, the CPU default)
against the per-row math, the dense reference and `capacity`."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.model import decoder, layer_loop
from qwen35_lib.model.parallelism import LOCAL
from qwen35_lib.plan import SINGLE


def test_unrolled_forward_equals_the_scan(tiny):
    cfg, w = tiny
    assert layer_loop.unrolled(cfg) and not layer_loop.unrolled(cfg, SINGLE.bind(None, platform="tpu"))
    split = layer_loop.prepare_weights(cfg, w)
    assert layer_loop.is_per_layer(split["layers"]) and layer_loop.prepare_weights(cfg, w)["layers"] is split["layers"]
    decoder.check_weights(cfg, split)  # the per-layer form is a valid weight tree
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    lengths = jnp.asarray([40, 23], jnp.int32)
    scan = decoder.forward_prepared(cfg, LOCAL, w, jnp.asarray(ids), lengths)  # stacked weights: the scan
    unrolled = decoder.forward_prepared(cfg, LOCAL, split, jnp.asarray(ids), lengths)
    for b, n in enumerate([40, 23]):
        np.testing.assert_allclose(np.asarray(unrolled)[b, :n], np.asarray(scan)[b, :n], rtol=1e-5, atol=1e-5)


def test_per_layer_cache_splits_each_pool_once(tiny):
    """Each pool [R, L, ...] of a kind -> L arrays [R, ...] equal to its layers (the CPU engine's form); a plan
    bound for a TPU keeps the one pool a kind; a split cache passes through."""
    from qwen35_lib.engine.cache import CacheShape, init_cache

    cfg, _ = tiny
    cache = init_cache(cfg, CacheShape(num_pages=4, page_size=8, num_slots=3))
    cache = {n: a + jnp.arange(a.size, dtype=jnp.float32).reshape(a.shape).astype(a.dtype) for n, a in cache.items()}
    split = layer_loop.per_layer_cache(cfg, cache)
    for name, pool in cache.items():
        assert len(split[name]) == pool.shape[1]
        for j, a in enumerate(split[name]):
            np.testing.assert_array_equal(a, pool[:, j])
    assert layer_loop.per_layer_cache(cfg, cache, SINGLE.bind(None, platform="tpu")) is cache
    assert layer_loop.per_layer_cache(cfg, split) == split



class _Meta(NamedTuple):  # the field `LayerPools.rows` moves (the engine's RaggedMeta has it too)
    slot: jax.Array


def test_layer_pools_read_and_write_layer_j_in_either_form(tiny):
    """`LayerPools`: layer j's pool is its own buffer (per-layer) or the whole merged pool with its slots moved to
    rows j*NS + slot (stacked); a write through either lands in layer j, and `cache()` gives the cache's form back."""
    from qwen35_lib.engine.cache import CacheShape, init_cache

    cfg, _ = tiny
    cache = init_cache(cfg, CacheShape(num_pages=4, page_size=8, num_slots=3))
    L, NS = cache["state"].shape[1:3]  # [R, L, NS, Hv, dk, dv]
    j, meta = L - 1, _Meta(jnp.asarray([[2, 0]]))
    want = cache["state"].at[:, j, 2].set(1)
    for form in (cache, layer_loop.per_layer_cache(cfg, cache)):
        stacked = not layer_loop.is_per_layer(form["state"])
        pools = layer_loop.LayerPools.of(form)
        own = pools.get(j, ("state", "not_a_pool"))
        slot = pools.rows(meta, "slot", "state", j).slot
        assert list(own) == ["state"] and slot.tolist() == ([[j * NS + 2, j * NS]] if stacked else [[2, 0]])
        out = pools.put(j, {"state": own["state"].at[:, slot[0, 0]].set(1)}).cache()
        assert jax.tree.structure(out) == jax.tree.structure(form)
        np.testing.assert_array_equal(out["state"] if stacked else jnp.stack(out["state"], 1), want)
