"""The serving engine against its references: repeated full forward passes, transformers' generate, itself."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen35_lib import forward, get_config, init_weights
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams

# One engine shape for the whole module: the jitted step is compiled once per bucket and shared.
EC = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=160)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("qwen3.5-tiny", dtype="float32", eos_token_ids=())
    return cfg, init_weights(cfg, 0)


def greedy_by_forward(cfg, w, prompt, n):
    """Greedy decoding by full forward passes over the whole sequence so far (one padded shape: one compile)."""
    ids = list(prompt)
    for _ in range(n):
        row = np.zeros((1, EC.max_model_len), np.int32)
        row[0, : len(ids)] = ids
        ids.append(int(np.asarray(forward(cfg, w, row, [len(ids)]))[0, len(ids) - 1].argmax()))
    return ids[len(prompt):]


def test_greedy_equals_repeated_forward(tiny):
    cfg, w = tiny
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (130, 1, 70, 5, 33)]  # 130 > one 64-token chunk
    engine = Engine(cfg, w, EC)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    for p, r in zip(prompts, results):
        assert r.output_ids == greedy_by_forward(cfg, w, p, 4) and r.finish_reason == "length"
    assert engine.stats.mixed_steps >= 1  # decodes and prefill chunks in one step
    assert max(engine.stats.seqs) >= 3  # several sequences per step


def test_steps_are_traced_at_most_once_per_bucket(tiny):
    cfg, w = tiny
    rng = np.random.default_rng(1)
    engine = Engine(cfg, w, EC)
    engine.generate([rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 90, 12)],
                    SamplingParams(max_new_tokens=5))
    assert engine.stats.steps > 2 * len(engine.stats.buckets)
    assert engine.stats.traces <= len(engine.stats.buckets)  # this engine's own count (earlier engines may have traced)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_outputs_do_not_depend_on_company(tiny, data):
    """Each request's output is the same alone or among others arriving at random steps, with a page pool small
    enough that requests get preempted and recomputed (sampled requests included: per-request seeds)."""
    cfg, w = tiny
    n = data.draw(st.integers(3, 6), label="requests")
    prompts = [data.draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=1, max_size=90)) for _ in range(n)]
    params = [SamplingParams(max_new_tokens=data.draw(st.integers(1, 8)),
                             temperature=data.draw(st.sampled_from([0.0, 0.0, 0.8])), top_k=5, top_p=0.9,
                             seed=data.draw(st.integers(0, 2**31))) for _ in range(n)]
    arrivals = [data.draw(st.integers(0, 6)) for _ in range(n)]
    alone = [Engine(cfg, w, EC).generate([p], [sp])[0].output_ids for p, sp in zip(prompts, params)]

    tight = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=160, num_pages=21)
    engine = Engine(cfg, w, tight)
    ids, step = {}, 0
    while len(ids) < n or engine.has_work:
        for i in range(n):
            if arrivals[i] == step:
                ids[i] = engine.add_request(prompts[i], params[i])
        engine.step()
        step += 1
    assert [engine.results[ids[i]].output_ids for i in range(n)] == alone


def test_page_exhaustion_preempts_and_recomputes(tiny):
    cfg, w = tiny
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.vocab_size, 10).tolist() for _ in range(4)]  # 4 x 70 tokens > 20 pages of 8
    small = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=160, num_pages=21)
    engine = Engine(cfg, w, small)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=60))
    assert engine.preemptions > 0 and sum(engine.stats.recomputed) > 0
    assert [r.output_ids for r in results] == [greedy_by_forward(cfg, w, p, 60) for p in prompts[:1]] + \
        [r.output_ids for r in Engine(cfg, w, EC).generate(prompts[1:], SamplingParams(max_new_tokens=60))]


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty prompt"),
    ([1] * 150, SamplingParams(max_new_tokens=20), "exceeds max_model_len=160"),
    ([300], SamplingParams(), r"token id 300 is outside the vocabulary \[0, 256\)"),
])
def test_bad_requests_are_refused_without_harming_running_ones(tiny, prompt, params, match):
    cfg, w = tiny
    engine = Engine(cfg, w, EC)
    good = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3))
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    while engine.has_work:
        engine.step()
    assert len(engine.results[good].output_ids) == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature must be >= 0"), (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be an integer >= 0"), (dict(max_new_tokens=0), "max_new_tokens must be"),
])
def test_invalid_sampling_parameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_engine_config_that_cannot_hold_one_request():
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=160"):
        _ = EngineConfig(max_model_len=160, page_size=8, num_pages=10).pages


@pytest.mark.reference
@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_next"])
def test_greedy_equals_transformers_generate(tmp_path, model_type):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from qwen35_lib import load_hf_checkpoint
    from qwen35_lib.testing import make_hf_model, save_hf_checkpoint

    model = make_hf_model(model_type, seed=4)
    cfg, w = load_hf_checkpoint(save_hf_checkpoint(model, tmp_path / model_type, "fused" if model_type ==
                                                   "qwen3_5_moe" else "per_expert"))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (100, 7, 66)]  # 100, 66 > a 64-token chunk
    results = Engine(cfg, w, EC).generate(prompts, SamplingParams(max_new_tokens=6))
    for p, r in zip(prompts, results):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=list(
                cfg.eos_token_ids), pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == out


def test_data_parallel_ranks_have_their_own_pools_and_same_outputs(tiny):
    cfg, w = tiny
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in (40, 3, 70, 12)]
    params = SamplingParams(max_new_tokens=3)
    two = Engine(cfg, w, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=160,
                                      ranks=2))
    ids = [two.add_request(p, params) for p in prompts]
    assert {two.ranks[0].waiting[0].id, two.ranks[1].waiting[0].id} == {ids[0], ids[1]}  # balanced by load
    while two.has_work:
        two.step()
    assert [two.results[i].output_ids for i in ids] == [r.output_ids for r in Engine(cfg, w, EC).generate(
        prompts, params)]


def test_non_integer_prompt_is_refused(tiny):
    cfg, w = tiny
    with pytest.raises(ValueError, match="integer token ids; element 0 is float 1.5"):
        Engine(cfg, w, EC).add_request([1.5, 2.0])
