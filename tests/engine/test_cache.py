"""engine.cache: the caches' bytes per device, and the memory check (each accelerator alone, CPU devices
together in host RAM), and the forks' row copies."""

import jax
import numpy as np

from qwen35_lib import get_config
from qwen35_lib.engine import cache as cache_module
from qwen35_lib.engine.cache import CacheShape, copy_rows, device_cache_bytes, memory_shortfall
from qwen35_lib.plan import get_layout, make_mesh


class FakeAccelerator:
    platform, process_index = "gpu", 0

    def __init__(self, i: int, limit: int, used: int):
        self.id, self.stats = i, {"bytes_limit": limit, "bytes_in_use": used}

    def memory_stats(self):
        return self.stats

    def __repr__(self):
        return f"gpu:{self.id}"


def test_accelerators_are_checked_each_on_its_own_and_cpu_devices_together(monkeypatch):
    cfg, shape, gib = get_config("qwen3.5-tiny"), CacheShape(), 2**30
    gpus = [FakeAccelerator(0, 16 * gib, 4 * gib), FakeAccelerator(1, 16 * gib, 7 * gib)]
    monkeypatch.setattr(cache_module, "device_cache_bytes", lambda c, s, m, p=None: {g: 10 * gib for g in gpus})
    assert memory_shortfall(cfg, shape) == "the caches need 10.00 GiB but 9.00 GiB is free (gpu memory of gpu:1)"
    gpus[1].stats["bytes_in_use"] = 6 * gib
    assert memory_shortfall(cfg, shape) is None  # 10 GiB on each of two devices with 12 and 10 free
    cpus = make_mesh().devices.flat[:2]
    monkeypatch.setattr(cache_module, "device_cache_bytes", lambda c, s, m, p=None: {d: 10 * gib for d in cpus})
    monkeypatch.setattr(cache_module, "available_bytes", lambda d: (12 * gib, "host RAM, MemAvailable"))
    assert memory_shortfall(cfg, shape) == "the caches need 20.00 GiB but 12.00 GiB is free (host RAM, MemAvailable)"


def test_a_data_parallel_cache_counts_each_devices_shards():
    cfg, mesh = get_config("qwen3.5-tiny"), make_mesh()
    shape = CacheShape(ranks=8, num_pages=33, page_size=8, num_slots=5)
    per_device = device_cache_bytes(cfg, shape, mesh, get_layout("dp8_ep8").bind(mesh, cfg))
    (total,) = device_cache_bytes(cfg, shape).values()
    assert len(per_device) == 8 and set(per_device.values()) == {total // 8}  # each device one rank's pools


def test_copy_rows_copies_pages_and_slots_of_every_layer_on_each_rank():
    """Pooled [R, L, X, ...] and per-layer (tuples of [R, X, ...]) forms; (0, 0) pads touch nothing else."""
    rng = np.random.default_rng(0)
    kv = rng.normal(size=(2, 3, 6, 4)).astype(np.float32)  # [R, L, pages, .]
    state = rng.normal(size=(2, 5, 2)).astype(np.float32)  # [R, slots, .]
    cache = {"kv": kv, "state": (state, state + 1)}
    pages = np.array([[[2, 5], [0, 0]], [[1, 3], [4, 2]]], np.int32)  # [R, K, 2]
    slots = np.array([[[1, 4], [0, 0]], [[0, 0], [0, 0]]], np.int32)
    out = jax.jit(copy_rows)(cache, pages, slots)
    want = kv.copy()
    want[0, :, 5], want[1, :, 3], want[1, :, 2] = kv[0, :, 2], kv[1, :, 1], kv[1, :, 4]
    np.testing.assert_array_equal(out["kv"], want)
    for got, before in zip(out["state"], cache["state"]):
        want = before.copy()
        want[0, 4] = before[0, 1]
        np.testing.assert_array_equal(got, want)


def test_a_word_stored_pool_is_the_fp8_pool_in_uint32_words():
    """`CacheShape.kv_words`: the FP8 KV pool as uint32 words, four values a word (the same bytes); the XLA
    attention asks for it on a TPU only, and only an FP8 cache can be word-stored."""
    import jax.numpy as jnp
    import pytest

    from qwen35_lib.engine.cache import declare_cache
    from qwen35_lib.kernels import get

    cfg = get_config("qwen3.5-tiny")
    fp8 = CacheShape(kv_dtype="float8_e4m3fn")
    values, words = declare_cache(cfg, fp8)["kv"], declare_cache(cfg, CacheShape(kv_dtype="float8_e4m3fn",
                                                                                    kv_words=True))["kv"]
    assert words.dtype == jnp.uint32 and words.shape == (*values.shape[:-1], values.shape[-1] // 4)
    assert words.nbytes == values.nbytes and words.logical_axes == values.logical_axes
    with pytest.raises(ValueError, match="kv_words stores an FP8 KV cache"):
        CacheShape(kv_words=True)
    assert [get("attention", n, p).kv_words for n in ("xla", "items") for p in ("tpu", "cpu")] == [True, False] * 2
    assert not get("attention", "pallas", "tpu").kv_words  # the Pallas kernel DMAs the FP8 pool as it is


def test_for_requests_holds_each_ranks_sequences_whole_contexts_and_the_null_page_and_slot():
    """`CacheShape.for_requests`, the one pool-for-N-requests formula: 10 requests over 4 ranks are 3 a rank (the
    round-up), 40 tokens in pages of 16 are 3 pages each: 9 pages + the null page, 3 slots + the null slot."""
    s = CacheShape.for_requests(10, 40, ranks=4, page_size=16, kv_dtype="float8_e4m3fn", kv_words=True)
    assert s == CacheShape(ranks=4, num_pages=10, page_size=16, num_slots=4, kv_dtype="float8_e4m3fn",
                           kv_words=True)
    assert s.seqs_per_rank == 3
    assert CacheShape.for_requests(8, 32, ranks=8, page_size=16) == CacheShape(8, 3, 16, 2)  # one each, 2 pages


def test_abstract_cache_is_the_declared_caches_with_their_shardings():
    """`abstract_cache`: `declare_cache`'s leaves as ShapeDtypeStructs, each with its own `cache_shardings` entry
    (by name), or unsharded without a mesh."""
    from qwen35_lib.engine.cache import abstract_cache, cache_shardings, declare_cache

    cfg, mesh = get_config("qwen3.5-tiny"), make_mesh()
    plan = get_layout("dp8_ep8").bind(mesh, cfg)
    shape = CacheShape.for_requests(10, 40, ranks=8, page_size=8, kv_dtype="float8_e4m3fn")
    decl, shardings = declare_cache(cfg, shape), cache_shardings(cfg, plan, shape, mesh)
    got = abstract_cache(cfg, shape, plan, mesh)
    assert set(got) == set(decl) and "kv_scale" in got
    for name, info in decl.items():
        assert (got[name].shape, got[name].dtype, got[name].sharding) == (info.shape, info.dtype, shardings[name])
    assert {k: (a.shape, a.dtype) for k, a in abstract_cache(cfg, shape).items()} == \
        {k: (i.shape, i.dtype) for k, i in decl.items()}
