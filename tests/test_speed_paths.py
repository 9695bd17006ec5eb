"""The CPU fast paths against the paths they replace: the unrolled layer loop (per-layer weight leaves) vs the
scan, the all-greedy sampling branch vs the sorted one, padding tokens routed to no expert,
`Engine.precompile` (a run after it compiles nothing), and the expert-loop MoE (`moe_loop`, the CPU default)
against the per-row math, the dense reference and `capacity`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
from qwen35_lib.engine.sampling import sample, sample_sorted
from qwen35_lib.kernels import moe_xla, registry
from qwen35_lib.kernels.registry import get
from qwen35_lib.model import decoder, layer_loop
from qwen35_lib.model.moe import local_moe, moe_dense_reference, shared_expert
from qwen35_lib.model.parallelism import LOCAL
from qwen35_lib.plan import SINGLE
from qwen35_lib.weights import dequantize_fp8, quantize_fp8


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("qwen3.5-tiny", dtype="float32", eos_token_ids=())
    return cfg, init_weights(cfg, 0)


def test_unrolled_forward_equals_the_scan(tiny):
    cfg, w = tiny
    assert layer_loop.unrolled(cfg) and not layer_loop.unrolled(cfg, SINGLE.resolve_kernels("tpu"))
    split = layer_loop.prepare_weights(cfg, w)
    assert layer_loop.is_per_layer(split["layers"]) and layer_loop.prepare_weights(cfg, w)["layers"] is split["layers"]
    decoder.check_weights(cfg, split)  # the per-layer form is a valid weight tree
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    lengths = jnp.asarray([40, 23], jnp.int32)
    scan = decoder._forward(cfg, LOCAL, w, jnp.asarray(ids), lengths)  # stacked weights: the scan
    unrolled = decoder._forward(cfg, LOCAL, split, jnp.asarray(ids), lengths)
    for b, n in enumerate([40, 23]):
        np.testing.assert_allclose(np.asarray(unrolled)[b, :n], np.asarray(scan)[b, :n], rtol=1e-5, atol=1e-5)


def test_all_greedy_branch_equals_the_sorted_path():
    rng = np.random.default_rng(0)
    N, V = 6, 97
    logits = jnp.asarray(rng.standard_normal((N, V)), jnp.float32)
    zeros, ones = jnp.zeros(N, jnp.float32), jnp.ones(N, jnp.float32)
    seed, pos, top_k = jnp.arange(N, dtype=jnp.uint32), jnp.arange(N, dtype=jnp.int32) + 5, jnp.zeros(N, jnp.int32)
    greedy = jax.jit(sample)(logits, zeros, top_k, ones, seed, pos)
    np.testing.assert_array_equal(greedy, sample_sorted(logits, zeros, top_k, ones, seed, pos))
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), -1))
    # one sampled row: the sorted path for the whole batch, the same seeded draws as before
    temp = zeros.at[2].set(0.8)
    mixed = jax.jit(sample)(logits, temp, top_k.at[2].set(20), ones.at[2].set(0.9), seed, pos)
    np.testing.assert_array_equal(mixed, sample_sorted(logits, temp, top_k.at[2].set(20), ones.at[2].set(0.9),
                                                       seed, pos))
    np.testing.assert_array_equal(np.delete(np.asarray(mixed), 2), np.delete(np.asarray(greedy), 2))


SEEN = []  # group sizes the spy kernel was given (eager calls only)


def _spy(x, group_sizes, w_gate_up, w_down, fp8_block=None):
    SEEN.append(np.asarray(group_sizes))
    return get("moe_matmul", "ragged_dot")(x, group_sizes, w_gate_up, w_down, fp8_block)


@pytest.fixture
def spy_kernel(monkeypatch):
    """`_spy` registered as moe_matmul "test_spy" for one test only (other modules list the registry's kernels:
    `bench kernels` would run it under jit)."""
    monkeypatch.setitem(registry._IMPLS["moe_matmul"], "test_spy", _spy)
    SEEN.clear()


@pytest.mark.usefixtures("spy_kernel")
def test_padding_tokens_route_to_no_expert(tiny):
    cfg, w = tiny
    spy = SINGLE.replace(moe_kernel="test_spy")
    moe = jax.tree.map(lambda a: a[0, 1], w["layers"]["moe"])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((24, cfg.hidden_size)), jnp.float32)
    valid = jnp.arange(24) % 3 != 0  # 16 real tokens, 8 padding
    SEEN.clear()
    got = local_moe(cfg, moe, x, valid, spy)
    (sizes,) = SEEN
    assert sizes.shape == (cfg.num_experts,) and sizes.sum() == 16 * cfg.num_experts_per_tok  # no padding copy
    ref = local_moe(cfg, moe, x[np.asarray(valid)], plan=spy)  # the real tokens alone
    np.testing.assert_allclose(got[np.asarray(valid)], ref, rtol=1e-5, atol=1e-6)
    pad = ~np.asarray(valid)  # routed part 0: the shared expert alone
    np.testing.assert_allclose(got[pad], shared_expert(moe, x)[pad], rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("spy_kernel")
def test_padding_does_not_push_capacity_into_its_fallback(tiny):
    """512 identical padding tokens (id 0's hidden state) with 64 real ones: the capacity kernel's groups hold only
    the real tokens' copies, so none exceeds its capacity (the fallback is not taken)."""
    cfg, w = tiny
    spy = SINGLE.replace(moe_kernel="test_spy")
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    real = np.random.default_rng(2).standard_normal((64, cfg.hidden_size)).astype(np.float32)
    x = jnp.asarray(np.concatenate([real, np.repeat(np.asarray(w["embed"][:1]), 512, 0)]))
    SEEN.clear()
    local_moe(cfg, moe, x, jnp.arange(576) < 64, spy)
    local_moe(cfg, moe, x, plan=spy)  # unmasked, as before: every padding copy lands on the same k experts
    masked, unmasked = SEEN
    N, E = 576 * cfg.num_experts_per_tok, cfg.num_experts
    C = -(-int(np.ceil(N / E + 4 * np.sqrt(N / E) + 2)) // 8) * 8  # `moe_capacity`'s slots per expert
    assert masked.max() <= C < unmasked.max()


EC = EngineConfig(max_num_seqs=3, max_num_batched_tokens=32, page_size=4, max_model_len=72)  # shapes of this module


def test_precompile_leaves_nothing_to_compile(tiny):
    cfg, w = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (40, 9, 21)]
    engine = Engine(cfg, w, EC)
    info = engine.precompile([len(p) for p in prompts], 6)
    assert info["buckets"] and info["compiled"] == len(info["buckets"])  # this module's shapes: new to the process
    assert engine.stats.steps == 0
    results = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert engine.stats.traces == 0  # the engine's own count: nothing traced after precompile
    assert sorted(engine.stats.buckets) == sorted(info["buckets"])
    alone = Engine(cfg, w, EC).generate([prompts[1]], SamplingParams(max_new_tokens=6))[0]
    assert results[1].output_ids == alone.output_ids  # the padding steps left no trace in the cache
    with pytest.raises(ValueError, match="not one this engine forms"):
        engine.precompile(buckets=[(3, 5)])


@pytest.mark.parametrize("kernel", ["loop tile=None", "loop tile=1", "loop tile=4", "loop tile=4 rows=60",
                                    "blocked block=3 tile=2"])
@pytest.mark.parametrize("sizes", [[0, 5, 0, 0, 9, 1], [3, 2, 0, 4, 1, 5], [0, 17, 0, 0, 1, 0], [0] * 6])
def test_moe_loop_rows_equal_each_rows_expert(kernel, sizes):
    """The expert loop and its blocked form (`moe_loop` runs as `moe_blocked` at decode sizes: tile=None, 20 rows
    over 6 experts): each real row is its own expert's SwiGLU FFN (groups longer than a tile, empty groups, a
    block's padding tiles), padding rows (past the sum of the sizes) are 0."""
    E, D, F = 6, 16, 8
    name, *opts = kernel.split()
    opts = {k: int(v) for k, v in (o.split("=") for o in opts if o != "tile=None")}
    rows = opts.pop("rows", 20)
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    sizes = jnp.array(sizes, jnp.int32)
    x = jax.random.normal(kx, (rows, D))
    wgu, wd = jax.random.normal(kw, (E, D, 2, F)), jax.random.normal(kd, (E, F, D))
    fn = {"loop": moe_xla.moe_loop, "blocked": moe_xla.moe_blocked}[name]
    y = np.asarray(jax.jit(lambda *a: fn(*a, **opts))(x, sizes, wgu, wd))
    expert = np.repeat(np.arange(E), np.asarray(sizes))
    n = int(sizes.sum())
    for r in range(n):
        h = x[r] @ wgu[expert[r]].reshape(D, 2 * F)
        np.testing.assert_allclose(y[r], (jax.nn.silu(h[:F]) * h[F:]) @ wd[expert[r]], atol=1e-4, rtol=1e-5)
    assert not y[n:].any()


@pytest.mark.parametrize("n", [1, 8, 333])  # 1 and 8 tokens (3 and 24 rows over 8 experts): the blocked form
def test_moe_loop_layer_matches_dense_and_capacity(tiny, n):
    cfg, w = tiny
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    moe["router"] = moe["router"] * 50  # sharper routing: some experts get no tokens
    x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size))
    run = jax.jit(lambda c, p, w, x: local_moe(c, w, x, plan=p), static_argnums=(0, 1))
    got = run(cfg, SINGLE.replace(moe_kernel="loop"), moe, x)
    np.testing.assert_allclose(got, moe_dense_reference(cfg, moe, x), atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(got, run(cfg, SINGLE.replace(moe_kernel="capacity"), moe, x), atol=1e-6, rtol=1e-5)
    assert registry.default_name("moe_matmul") == SINGLE.kernel("moe_matmul") == "loop"  # the CPU default


def test_moe_loop_fp8_experts_match_dequantized(tiny):
    cfg, w = tiny
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    cfg8 = cfg.replace(expert_dtype="float8_e4m3fn", fp8_block_size=16)
    loop, ragged_dot = SINGLE.replace(moe_kernel="loop"), SINGLE.replace(moe_kernel="ragged_dot")
    w8 = dict(moe, w_gate_up=quantize_fp8(moe["w_gate_up"], 16, (1, 3)), w_down=quantize_fp8(moe["w_down"], 16, (1, 2)))
    wdq = dict(moe, **{k: dequantize_fp8(w8[k], 16, jnp.float32) for k in ("w_gate_up", "w_down")})
    for n in (40, 8):  # 120 rows over 8 experts: the loop; 24 rows: the blocked form
        x = jax.random.normal(jax.random.key(9), (n, cfg.hidden_size))
        np.testing.assert_allclose(local_moe(cfg8, w8, x, plan=loop), local_moe(cfg, wdq, x, plan=loop),
                                   atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(local_moe(cfg8, w8, x, plan=loop), local_moe(cfg, wdq, x, plan=ragged_dot),
                                   atol=1e-5, rtol=1e-5)
