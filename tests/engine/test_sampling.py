"""The sampler's logits processing (penalties, logit_bias, allowed_token_ids, bad words, min_tokens) and min_p:
the batched JAX path against its NumPy reference twins, row by row, and the engine's greedy outputs with each
parameter against a reference decode (the full forward, the reference processing, argmax)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
from qwen35_lib.engine.sampling import (
    fill_processing_row,
    process_logits,
    processing_arrays,
    reference_keep,
    reference_logits,
    sample,
    sample_sorted,
    sorted_keep,
    target_probs,
    token_keys,
)
from qwen35_lib.model import decoder
from qwen35_lib.model.layer_loop import prepare_weights
from qwen35_lib.model.parallelism import LOCAL
from qwen35_lib.plan import get_layout, make_mesh

V = 61
CASES = [
    SamplingParams(),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.7),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, presence_penalty=0.3, frequency_penalty=0.4),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0, 11: 250.0}),
    SamplingParams(allowed_token_ids=[2, 5, 9, 40]),
    SamplingParams(bad_words_ids=[[4], [8, 9], [1, 2, 3]]),
    SamplingParams(min_tokens=5, stop_token_ids=[6]),
    SamplingParams(min_tokens=2, stop_token_ids=[6], logit_bias={6: 30.0}, allowed_token_ids=[6, 12, 13]),
]


def _history(rng, n):
    return [int(t) for t in rng.integers(0, 15, n)]  # small ids: repeats, bad-word prefixes and stop ids occur


def test_processing_equals_reference_row_by_row():
    rng = np.random.default_rng(0)
    rows = []
    for i, p in enumerate(CASES * 3):
        prompt, output = _history(rng, int(rng.integers(1, 9))), _history(rng, int(rng.integers(0, 9)))
        if i % 3 == 1 and p.bad_words_ids:
            output += [8, 1, 2]  # ends in a bad word's prefix
        rows.append((p, prompt, output, (1,)))
    logits = rng.standard_normal((len(rows), V)).astype(np.float32) * 3
    arr = processing_arrays((len(rows),), V)
    for i, (p, prompt, output, stop) in enumerate(rows):
        fill_processing_row(arr, i, p, prompt, output, stop)
    got = np.asarray(jax.jit(process_logits)(logits, arr))
    for i, (p, prompt, output, stop) in enumerate(rows):
        want = reference_logits(logits[i], p, prompt, output, stop)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"row {i}: {p}")
    # the features move the logits where the definitions say
    assert np.isneginf(got[6][[0, 1, 3]]).all() and np.isfinite(got[6][[2, 5, 9, 40]]).all()
    assert np.isneginf(got[7][4]) and np.isneginf(got[8][6]) and np.isneginf(got[8][1])
    assert got[5][11] == pytest.approx(logits[5][11] + 100, rel=1e-5)  # clamped to 100, as OpenAI does


def test_min_p_top_k_top_p_keep_equals_reference():
    rng = np.random.default_rng(1)
    params = [SamplingParams(temperature=t, min_p=m, top_k=k, top_p=tp) for t, m, k, tp in
              [(1.0, 0.0, 0, 1.0), (0.7, 0.1, 0, 1.0), (1.3, 0.05, 10, 0.9), (1.0, 0.3, 0, 0.5), (2.0, 0.0, 5, 0.8),
               (0.5, 0.9, 0, 1.0)]]
    logits = rng.standard_normal((len(params), V)).astype(np.float32) * 2
    col = lambda f, dt: np.asarray([getattr(p, f) for p in params], dt)
    order, _, keep = jax.jit(sorted_keep)(logits, col("temperature", np.float32), col("top_k", np.int32),
                                          col("top_p", np.float32), col("min_p", np.float32))
    order, keep = np.asarray(order), np.asarray(keep)
    for i, p in enumerate(params):
        got = np.zeros(V, bool)
        got[order[i][keep[i]]] = True
        np.testing.assert_array_equal(got, reference_keep(logits[i], p), err_msg=str(p))
    assert np.asarray(keep[1]).sum() > np.asarray(keep[5]).sum() >= 1  # a larger min_p keeps fewer


def test_target_probs_are_the_distribution_sample_draws_from():
    """Speculative sampling's p (`target_probs`): the reference's kept set renormalized at the temperature, a point
    mass on the argmax for a greedy row; and `sample` with the same keys draws as often as p says."""
    rng = np.random.default_rng(3)
    params = [SamplingParams(temperature=t, min_p=m, top_k=k, top_p=tp) for t, m, k, tp in
              [(1.0, 0.0, 0, 1.0), (0.7, 0.1, 0, 0.9), (1.3, 0.0, 4, 1.0), (0.0, 0.0, 0, 1.0)]]
    logits = rng.standard_normal((len(params), 9)).astype(np.float32) * 2
    col = lambda f, dt: np.asarray([getattr(p, f) for p in params], dt)
    probs = np.asarray(jax.jit(target_probs)(logits, col("temperature", np.float32), col("top_k", np.int32),
                                             col("top_p", np.float32), col("min_p", np.float32)))
    for i, p in enumerate(params[:-1]):
        keep = reference_keep(logits[i], p)
        want = np.where(keep, np.exp((logits[i] - logits[i].max()) / p.temperature), 0)
        np.testing.assert_allclose(probs[i], want / want.sum(), rtol=1e-5, atol=1e-7, err_msg=str(p))
    np.testing.assert_array_equal(probs[-1], np.eye(9)[np.argmax(logits[-1])])
    n, row = 4000, 1
    tiled = lambda f, dt: np.full(n, getattr(params[row], f), dt)
    drawn = np.asarray(jax.jit(sample)(np.repeat(logits[row:row + 1], n, 0), tiled("temperature", np.float32),
                                       tiled("top_k", np.int32), tiled("top_p", np.float32),
                                       np.zeros(n, np.uint32), np.arange(n, dtype=np.int32),
                                       tiled("min_p", np.float32)))
    assert np.abs(np.bincount(drawn, minlength=9) / n - probs[row]).sum() / 2 < 0.04
    keys = token_keys(jnp.asarray([[1, 1], [2, 2]], jnp.uint32), jnp.asarray([[5, 6], [5, 6]], jnp.int32))
    assert keys.shape == (2, 2) and len({str(jax.random.key_data(k)) for k in keys.reshape(-1)}) == 4


def test_sample_greedy_rows_take_the_processed_argmax_and_sampled_rows_stay_in_the_kept_set():
    rng = np.random.default_rng(2)
    N = 8
    logits = rng.standard_normal((N, V)).astype(np.float32) * 2
    params = [SamplingParams(repetition_penalty=3.0), SamplingParams(logit_bias={9: 9.0}),
              SamplingParams(temperature=0.9, min_p=0.2, presence_penalty=2.0), SamplingParams(temperature=1.0),
              SamplingParams(allowed_token_ids=[3, 4]), SamplingParams(temperature=1.5, top_k=3, min_p=0.01),
              SamplingParams(bad_words_ids=[[int(np.argmax(logits[6]))]]), SamplingParams(temperature=0.3, top_p=0.5)]
    hist = [(_history(rng, 6), _history(rng, 6)) for _ in range(N)]
    arr = processing_arrays((N,), V)
    for i, (p, (prompt, out)) in enumerate(zip(params, hist)):
        fill_processing_row(arr, i, p, prompt, out, (1,))
    col = lambda f, dt: np.asarray([getattr(p, f) for p in params], dt)
    for pos in range(20):  # several draws: each sampled row always lands in its reference kept set
        tokens = np.asarray(jax.jit(sample)(logits, col("temperature", np.float32), col("top_k", np.int32),
                                            col("top_p", np.float32), col("seed", np.uint32),
                                            np.full(N, pos, np.int32), col("min_p", np.float32), arr))
        for i, p in enumerate(params):
            ref = reference_logits(logits[i], p, *hist[i], (1,))
            if p.temperature == 0:
                assert tokens[i] == int(np.argmax(ref)), (i, p)
            else:
                assert reference_keep(ref, p)[tokens[i]], (i, p, pos)


# --- the engine, greedy, against a reference decode ---------------------------------------------------------------
_FORWARD: dict = {}


def _forward_fn(cfg, w):
    if id(w) not in _FORWARD:
        split = prepare_weights(cfg, w)
        _FORWARD[id(w)] = jax.jit(lambda row, n: decoder.forward_prepared(cfg, LOCAL, split, row, n))
    return _FORWARD[id(w)]


def reference_decode(cfg, w, prompt, p: SamplingParams, n: int) -> list[int]:
    """Greedy by repeated full forwards (one padded shape), each step's logits through `reference_logits`."""
    L = 64
    out: list[int] = []
    step = _forward_fn(cfg, w)
    stop = () if p.ignore_eos else (p.stop_token_ids if p.stop_token_ids is not None else cfg.eos_token_ids)
    for _ in range(n):
        ids = prompt + out
        row = np.zeros((1, L), np.int32)
        row[0, :len(ids)] = ids
        logits = np.asarray(step(row, np.asarray([len(ids)], np.int32)))[0, len(ids) - 1]
        t = int(np.argmax(reference_logits(logits, p, prompt, out, stop)))
        out.append(t)
        if t in stop:
            break
    return out


def test_engine_greedy_outputs_equal_the_reference_decode():
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(cfg, 0)
    engine = Engine(cfg, w, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=64))
    engine.decode_buckets = (8,)
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(2, 256, 7)]
    n = 8
    base = engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].output_ids
    first = base[0]
    cases = [SamplingParams(repetition_penalty=4.0), SamplingParams(presence_penalty=-2.0),
             SamplingParams(frequency_penalty=-2.0), SamplingParams(logit_bias={7: 100.0}),
             SamplingParams(allowed_token_ids=[5, 9, 200]), SamplingParams(bad_words_ids=[[first]]),
             SamplingParams(min_tokens=4, stop_token_ids=[first]), SamplingParams()]
    cases = [SamplingParams(**{**_fields(p), "max_new_tokens": n, "ignore_eos": p.stop_token_ids is None})
             for p in cases]
    results = engine.generate([prompt] * len(cases), cases)  # one batch: processed and plain rows together
    for p, r in zip(cases, results):
        assert r.output_ids == reference_decode(cfg, w, prompt, p, n), p
    assert results[-1].output_ids == base
    assert [i for i, r in enumerate(results[:-1]) if r.output_ids == base] == []  # each parameter changed it
    assert results[3].output_ids == [7] * n and set(results[4].output_ids) <= {5, 9, 200}
    assert first not in results[5].output_ids and results[6].output_ids[:4].count(first) == 0


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_sampling_params_are_checked():
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=20, max_new_tokens=4)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(TypeError, match="logit_bias"):
        SamplingParams(logit_bias={"a": 1})
    assert SamplingParams(logit_bias={3: 1}).logit_bias == ((3, 1.0),)
    assert not SamplingParams().processed and SamplingParams(min_tokens=1).processed


def test_processing_on_a_data_parallel_mesh_equals_one_device():
    """The [R, S, V] processing arrays are split over the ranks like the other sampling arrays: dp8_ep8 on 8
    (simulated) devices gives the single-device tokens."""

    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(cfg, 0)
    ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=48, page_size=8)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(2, 256, n)] for n in (5, 17, 1, 9, 30, 3)]
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True, **kw) for kw in
              (dict(logit_bias={7: 5.0}), dict(repetition_penalty=0.3), {}, dict(presence_penalty=-2.0),
               dict(allowed_token_ids=[3, 4, 5]), dict(bad_words_ids=[[10]], min_tokens=2))]
    ref = [r.output_ids for r in Engine(cfg, w, ec).generate(prompts, params)]
    mesh_engine = Engine(cfg, w, ec, mesh=make_mesh(), plan=get_layout("dp8_ep8").replace(routing="replicate"))
    assert [r.output_ids for r in mesh_engine.generate(prompts, params)] == ref
    assert ref[0] == [7] * 4 and set(ref[4]) <= {3, 4, 5}


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature="1"), "temperature must be a number, got '1'"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(max_new_tokens=4.0), "max_new_tokens must be an integer, got 4.0"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(top_p=None), "top_p must be a number, got None"),
    (dict(seed="7"), "seed must be an integer"),
    (dict(ignore_eos="yes"), "ignore_eos must be True or False"),
    (dict(stop_token_ids="12"), "stop_token_ids must be None or a sequence of integer token ids"),
    (dict(stop_token_ids=[1, 2.0]), "stop_token_ids must be None or a sequence of integer token ids"),
])
def test_sampling_parameters_of_the_wrong_type_are_named(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=float("nan")), "temperature must be >= 0"), (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(seed=2**32), r"seed must be an integer in \[0, 2\*\*32\)"), (dict(stop_token_ids=(-1,)), "ids >= 0"),
])
def test_sampling_parameters_out_of_range_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_scalars_become_python_numbers():
    sp = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_p=np.float64(0.9),
                        seed=np.uint32(5), stop_token_ids=[np.int32(2), 3])
    assert (type(sp.max_new_tokens), type(sp.temperature), type(sp.seed)) == (int, float, int)
    assert sp.stop_token_ids == (2, 3) and hash(sp) == hash(dataclasses.replace(sp))


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
