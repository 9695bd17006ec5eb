"""The engine's ragged step against `forward` (paged vs dense attention, slot-carried vs in-sequence GDN state)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import forward, get_config, init_weights
from qwen35_lib.engine.batch import SeqWork, pack, stack_ranks
from qwen35_lib.engine.cache import CacheShape, init_cache
from qwen35_lib.model import layer_loop
from qwen35_lib.model.ragged import ragged_forward
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.plan import SINGLE

step = jax.jit(lambda cfg, plan, *args: ragged_forward(cfg, *args, parallelism(plan)), static_argnums=(0, 1))
SHAPE = dict(ranks=1, num_pages=40, page_size=8, num_slots=6)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(cfg, 0)
    rng = np.random.default_rng(0)
    A, B = rng.integers(0, 256, 110).tolist(), rng.integers(0, 256, 20).tolist()
    ref = {"A": np.asarray(forward(cfg, w, np.array([A])))[0], "B": np.asarray(forward(cfg, w, np.array([B])))[0]}
    return cfg, w, A, B, ref


def run_schedule(cfg, w, A, B, kv_dtype=None, plan=SINGLE, per_layer=False, kv_words=False):
    """A: a 100-token prompt in chunks of 70 and 30 (the second starts mid-sequence, next to a decode of B);
    B: a 5-token prompt then decodes; then both decode (under the one-device `plan`: its kernels). per_layer: the
    weights and caches in their per-layer form (the CPU engine's, `model.layer_loop`), else stacked (the scan).
    kv_words: the FP8 pool as uint32 words (the XLA attention's on a TPU). Returns [(logits, sequence, position)]."""
    cache = init_cache(cfg, CacheShape(**SHAPE, kv_dtype=kv_dtype, kv_words=kv_words))
    if per_layer:
        w, cache = layer_loop.prepare_weights(cfg, w, plan), layer_loop.per_layer_cache(cfg, cache, plan)
        assert layer_loop.is_per_layer(w["layers"]) and all(map(layer_loop.is_per_layer, cache.values()))
    pages = {"A": list(range(1, 16)), "B": list(range(16, 20))}
    seqs = {"A": A, "B": B}
    slots = {"A": 1, "B": 2}
    work = lambda n, a, b: SeqWork(seqs[n][a:b], a, pages[n], slots[n])
    schedule = [([], [("A", 0, 70), ("B", 0, 5)]), ([("B", 5, 6)], [("A", 70, 100)])]
    schedule += [([("A", 100 + i, 101 + i), ("B", 6 + i, 7 + i)], []) for i in range(8)]
    out = []
    for decodes, prefills in schedule:
        tokens, meta = stack_ranks([pack([work(*d) for d in decodes], [work(*p) for p in prefills], D=4, T=196,
                                         S=4, max_pages=16, chunk=64)])
        logits, cache = step(cfg, plan, w, cache, jnp.asarray(tokens), jax.tree.map(jnp.asarray, meta))
        out += [(logits[0, s], n, b - 1) for s, (n, _, b) in enumerate(decodes + prefills)]
    return out


@pytest.mark.parametrize("per_layer", [False, True])
def test_ragged_step_matches_forward(tiny, per_layer):
    cfg, w, A, B, ref = tiny
    for logits, name, pos in run_schedule(cfg, w, A, B, per_layer=per_layer):
        np.testing.assert_allclose(logits, ref[name][pos], atol=2e-6)  # float32; same math, other order


def test_per_layer_pools_equal_the_stacked_ones_with_an_fp8_cache(tiny):
    """The per-layer form carries the FP8 cache's scales too: the same logits as the stacked pools."""
    cfg, w, A, B, _ = tiny
    stacked = run_schedule(cfg, w, A, B, "float8_e4m3fn")
    for (got, *_), (want, *_) in zip(run_schedule(cfg, w, A, B, "float8_e4m3fn", per_layer=True), stacked):
        np.testing.assert_allclose(got, want, atol=2e-6)


def test_a_word_stored_fp8_pool_gives_the_same_logits(tiny):
    """The FP8 pool as uint32 words (`CacheShape.kv_words`: how the XLA attention stores it on a TPU) holds the
    same bits: the step's logits equal the FP8 pool's exactly."""
    cfg, w, A, B, _ = tiny
    for (got, *_), (want, *_) in zip(run_schedule(cfg, w, A, B, "float8_e4m3fn", kv_words=True),
                                     run_schedule(cfg, w, A, B, "float8_e4m3fn")):
        np.testing.assert_array_equal(got, want)


def test_fp8_kv_cache_stays_close(tiny):
    """e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4) on K and V; through 1 attention layer of 4 that
    moves the logits by a few percent of their range, far less than a wrong page or scale would."""
    cfg, w, A, B, ref = tiny
    errs = [np.abs(np.asarray(lg) - ref[n][p]).max() for lg, n, p in run_schedule(cfg, w, A, B, "float8_e4m3fn")]
    spread = max(np.abs(r).max() for r in ref.values())
    assert max(errs) <= 0.05 * spread, (max(errs), spread)
    assert max(errs) > 0  # the FP8 path really ran
