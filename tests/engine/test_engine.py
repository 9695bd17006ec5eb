"""The serving engine against its references: repeated full forward passes, transformers' generate, itself."""

import resource

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen35_lib import forward
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
from qwen35_lib.engine import cache as cache_module
from qwen35_lib.plan import SINGLE

# One engine shape for the whole module: the jitted step is compiled once per bucket and shared.
EC = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=160)


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


def test_engine_knobs_pools_are_for_requests_and_the_engine_reads_them(engine):
    # with num_pages unset, each rank's pages are max_num_seqs whole contexts + the null page (`for_requests`)
    ec = EngineConfig(max_num_seqs=3, max_model_len=40, page_size=16, ranks=2, kv_dtype="float8_e4m3fn")
    assert ec.cache_shape() == cache_module.CacheShape.for_requests(6, 40, ranks=2, page_size=16,
                                                                   kv_dtype="float8_e4m3fn")
    assert ec.pages == 3 * 3 + 1 and EngineConfig(num_pages=80).cache_shape().num_pages == 80
    assert engine.cache_shape == engine.ec.cache_shape(engine.plan)
    assert engine.cache_shape.kv_dtype == engine.plan.kv_dtype == engine.ec.kv_dtype  # the bound plan's, its home
    assert engine.cache_shape.num_slots == engine.ec.max_num_seqs + 1


def test_a_plan_naming_an_unknown_kernel_is_refused_when_the_engine_is_built(tiny):
    """A kernel name no slot has is refused by `Engine(...)` in one line naming the slot's implementations, not at
    the first step's trace (where every queued request would fail with it)."""
    cfg, w = tiny
    with pytest.raises(ValueError, match="no 'gdn' kernel named 'bogus'; available: .*xla"):
        Engine(cfg, w, SMALL_EC, plan=SINGLE.replace(gdn_kernel="bogus"))


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
    two.add_request(prompts[2], params)  # rank 0 busy: the forks go to rank 1, copied there alone
    seeded = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=s) for s in range(3)]
    forks = run_forks(two, prompts[0], seeded)
    assert forks == [r.output_ids for r in Engine(cfg, w, EC).generate([prompts[0]] * 3, seeded)]


def test_non_integer_prompt_is_refused(tiny):
    cfg, w = tiny
    with pytest.raises(ValueError, match="integer token ids; element 0 is float 1.5"):
        Engine(cfg, w, EC).add_request([1.5, 2.0])


SMALL_EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, page_size=8, max_model_len=64)


@pytest.fixture
def engine(tiny):
    return Engine(*tiny, SMALL_EC)


@pytest.mark.parametrize("prompt, match", [
    ([[1, 2], [3, 4]], "element 0 is a nested sequence"),
    (np.array([[1, 2], [3, 4]]), r"shape \(2, 2\)"),
    ("1 2 3", "got str"),
    (7, "got int"),
    ({1, 2}, "got set"),
    ([1, True], "element 1 is bool True"),
    ([1.0, 2.0], "element 0 is float 1.0"),
    (np.array([1.5, 2.0]), "got float64 values"),
])
def test_a_prompt_is_a_1d_sequence_of_integers(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt)
    assert not engine.has_work


def test_integer_arrays_and_ranges_are_prompts(engine):
    for prompt in (np.array([1, 2, 3], np.int16), range(1, 4), (1, 2, 3), [np.int64(1), 2, 3]):
        engine.add_request(prompt)
    assert [r.prompt for r in engine.ranks[0].waiting] == [[1, 2, 3]] * 4


def test_stop_ids_outside_the_vocabulary_and_params_of_another_type_are_refused(engine):
    with pytest.raises(ValueError, match=r"stop token id 256 is outside the vocabulary \[0, 256\)"):
        engine.add_request([1], SamplingParams(stop_token_ids=(1, 256)))
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request([1], {"max_new_tokens": 3})
    assert not engine.has_work


@pytest.mark.parametrize("prompts, params, error, match", [
    ([[1, 2], [3, 4]], [SamplingParams()], ValueError, "2 prompts but 1 SamplingParams: give one per prompt"),
    ([[1, 2], [3, 4]], [SamplingParams()] * 3, ValueError, "2 prompts but 3 SamplingParams"),
    ([[1, 2], []], None, ValueError, "request 1: empty prompt"),
    ([[1, 2], [3, 999]], None, ValueError, "request 1: token id 999 is outside the vocabulary"),
    ([[1, 2], [3]], [SamplingParams(), "greedy"], TypeError, "request 1: a request's params must be a Sampling"),
    ([[1, 2], [3]], [SamplingParams(), SamplingParams(max_new_tokens=64)], ValueError, "request 1: .*max_model_len=64"),
    ([1, 2, 3], None, ValueError, "request 0: a prompt is a 1-D sequence of integer token ids; got int"),
    ("1 2 3", None, ValueError, "prompts is a sequence of prompts"),
])
def test_generate_checks_every_request_before_queueing_any(engine, prompts, params, error, match):
    with pytest.raises(error, match=match):
        engine.generate(prompts, params)
    assert not engine.has_work and engine.results == {}  # nothing left behind to run in the next call


def test_a_cache_larger_than_memory_is_refused_before_allocating(tiny, monkeypatch):
    """The CLI's defaults with max_model_len=10,000,000: 8 x 625,000 pages of 16 tokens, 38 GiB for the tiny
    model in float32. Told the host has 16 GiB, the engine names the knobs; nothing was allocated."""
    cfg, w = tiny
    monkeypatch.setattr(cache_module, "available_bytes", lambda d: (16 * 2**30, "host RAM, MemAvailable"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"the caches need 38\.15 GiB but 16\.00 GiB is free \(host RAM, MemAvailable"
                                         r"\) for 1 rank\(s\) x \(5000001 KV pages of 16 tokens, 9 GDN slots\): lower "
                                         r"max_num_seqs \(8\) or max_model_len \(10000000\), or set num_pages below "
                                         r"5000001, or use kv_dtype='float8_e4m3fn'$"):
        Engine(cfg, w, EngineConfig(max_model_len=10_000_000))
    with pytest.raises(ValueError, match=r"lower num_pages \(5000001\), or use kv_dtype"):
        Engine(cfg, w, EngineConfig(num_pages=5_000_001))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 2**20  # KiB: under 1 GiB more at peak


def test_the_real_memory_check_refuses_what_no_machine_has(tiny):
    cfg, w = tiny
    with pytest.raises(ValueError, match=r"the caches need \d+\.\d\d GiB but .* is free \(host RAM, MemAvailable\)"):
        Engine(cfg, w, EngineConfig(max_model_len=10_000_000, max_num_seqs=4096))  # 19 TiB in float32


def test_a_step_that_cannot_fit_is_refused_before_it_runs_and_leaves_the_engine_whole(tiny, monkeypatch):
    """The caches fit, the first step's temporaries do not: the step is refused (compiled, never run) with the
    knobs to lower; with the memory back, the same engine gives what a fresh one gives."""
    prompts, params = [[5, 6, 7, 8, 9], [3, 1, 4]], SamplingParams(max_new_tokens=4)
    engine = Engine(*tiny, SMALL_EC)
    for p in prompts:
        engine.add_request(p, params)
    monkeypatch.setattr(cache_module, "available_bytes", lambda d: (1024, "host RAM, MemAvailable"))
    with pytest.raises(ValueError, match=r"^the step needs \d+\.\d MiB of working memory beyond the caches but "
                                         r"0\.0 MiB is free \(host RAM, MemAvailable\) at 1 decode rows \+ 64 prefill "
                                         r"tokens per rank: lower max_model_len \(64\), max_num_seqs \(2\) or "
                                         r"max_num_batched_tokens \(16\)$"):
        engine.step()
    assert engine.stats.steps == 0
    monkeypatch.undo()
    while engine.has_work:
        engine.step()
    fresh = Engine(*tiny, SMALL_EC).generate(prompts, params)
    assert [engine.results[i].output_ids for i in range(2)] == [r.output_ids for r in fresh]


def test_abort_request_frees_its_pages_and_slot(engine):
    """A queued request is dropped; a running one gives back its pages and slot (the server's disconnect)."""
    sched = engine.ranks[0]
    pages, slots = len(sched.free_pages), len(sched.free_slots)
    a = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    b = engine.add_request([4, 5], SamplingParams(max_new_tokens=4))
    schedule = sched.schedule()  # a admitted (the thrash guard may hold b back): pages and a slot taken
    sched.commit(schedule, [0] * len(schedule.items))
    assert sched.running[0].id == a and len(sched.free_pages) < pages and len(sched.free_slots) < slots
    assert engine.abort_request(b) and engine.abort_request(a) and not engine.has_work  # queued or running
    assert (len(sched.free_pages), len(sched.free_slots)) == (pages, slots)
    assert not engine.abort_request(a) and a not in engine.results  # gone, with no result


# shapes no other test forms: precompile finds them new to the process
PRECOMPILE_EC = EngineConfig(max_num_seqs=3, max_num_batched_tokens=32, page_size=4, max_model_len=72)


def test_precompile_leaves_nothing_to_compile(tiny):
    cfg, w = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (40, 9, 21)]
    engine = Engine(cfg, w, PRECOMPILE_EC)
    info = engine.precompile([len(p) for p in prompts], 6)
    assert info["buckets"] and info["compiled"] == len(info["buckets"])  # this module's shapes: new to the process
    assert engine.stats.steps == 0
    results = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert engine.stats.traces == 0  # the engine's own count: nothing traced after precompile
    assert sorted(engine.stats.buckets) == sorted(info["buckets"])
    alone = Engine(cfg, w, PRECOMPILE_EC).generate([prompts[1]], SamplingParams(max_new_tokens=6))[0]
    assert results[1].output_ids == alone.output_ids  # the padding steps left no trace in the cache
    with pytest.raises(ValueError, match="not one this engine forms"):
        engine.precompile(buckets=[(3, 5)])


def test_a_mixed_step_keeps_the_reduce_scatters_rows_whole(tiny):
    """Where the MoE reduce-scatters each rank's rows over the mesh (EP + token replication), a step with a prefill
    region pads its decode rows so that all its rows are a multiple of 64 (`engine.rs_row_tile`: 8 + 64 rows would
    compile all-reduces and permutes on TPU7x); decode-only steps and one device keep the power-of-two buckets."""
    from qwen35_lib.engine.step import rs_row_tile
    from qwen35_lib.plan import get_stage, make_mesh

    cfg, w = tiny
    mesh = make_mesh()
    ep = Engine(cfg, w, EC, mesh=mesh, plan=get_stage("replicate"))
    assert ep.row_tile == 64 == rs_row_tile(ep.plan)
    assert ep.step_shape(3, 64) == (64, 128) and ep.step_shape(3, 0) == (4, 4)
    assert all(T % 64 == 0 for D, T in ep.buckets() if T > D)
    assert Engine(cfg, w, EC).step_shape(3, 64) == (4, 68)
    assert rs_row_tile(get_stage("dp_ep").bind(mesh, cfg)) == 1  # all-to-all routing: no reduce-scatter
    with pytest.raises(ValueError, match="not one this engine forms"):
        ep.precompile(buckets=[(4, 68)])


def run_forks(engine, prompt, params):
    ids = engine.add_forks(prompt, params)
    while engine.has_work:
        engine.step()
    return [engine.results.pop(i).output_ids for i in ids]


@pytest.mark.parametrize("length", [37, 33])  # the last prompt token mid-page (its page copied) or opening one
def test_forks_prefill_the_prompt_once_and_sample_as_separate_requests(tiny, length):
    """n choices on one prompt (vLLM's parallel sampling): the prompt but its last token computed once, then each
    fork decodes from a shared copy of it; greedy and seeded outputs equal those of separate requests, and every
    page comes back."""
    cfg, w = tiny
    prompt = np.random.default_rng(length).integers(0, cfg.vocab_size, length).tolist()
    params = [SamplingParams(max_new_tokens=6)] + [SamplingParams(max_new_tokens=6, temperature=0.9, seed=s)
                                                    for s in (1, 2)]
    alone = [r.output_ids for r in Engine(cfg, w, EC).generate([prompt] * 3, params)]
    engine = Engine(cfg, w, EC)
    pages = len(engine.ranks[0].free_pages)
    assert run_forks(engine, prompt, params) == alone and len(set(map(tuple, alone[1:]))) == 2
    assert sum(engine.stats.tokens) == (length - 1) + 3 * 6  # the shared prefix once; each fork its own tokens
    assert len(engine.ranks[0].free_pages) == pages and not engine.ranks[0].shared


def test_forks_beyond_the_free_slots_prefill_alone(tiny):
    """More choices than free sequences: the forks that find no slot wait and prefill the prompt themselves, with
    the same outputs; an aborted fork gives no result and the rest go on."""
    cfg, w = tiny
    prompt = list(range(3, 23))
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=s) for s in range(6)]  # 6 > max_num_seqs 4
    alone = [r.output_ids for r in Engine(cfg, w, EC).generate([prompt] * 6, params)]
    engine = Engine(cfg, w, EC)
    assert run_forks(engine, prompt, params) == alone
    assert sum(engine.stats.tokens) == 19 + 4 * 3 + 2 * (20 + 2)  # 4 running from the prefix, 2 alone
    ids = engine.add_forks(prompt, params[:3])
    assert engine.abort_request(ids[1]) and engine.abort_request(ids[0])  # a pending fork, then the group's first
    while engine.has_work:
        engine.step()
    assert set(engine.results) == {ids[2]} and engine.results[ids[2]].output_ids == alone[2]


def test_forks_on_a_data_parallel_mesh_copy_within_their_rank(tiny):
    """dp8_ep8 on 8 (simulated) devices: the forks' page and slot copies run on the rank's own shard (the pools
    split over the ranks), with the single-device outputs."""
    from qwen35_lib.plan import get_layout, make_mesh

    cfg, w = tiny
    ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=48, page_size=8)
    prompt = list(range(5, 16))  # 11 tokens: the last one mid-page (a page copy)
    params = [SamplingParams(max_new_tokens=4, temperature=1.0, seed=s) for s in (3, 4)]
    want = [r.output_ids for r in Engine(cfg, w, ec).generate([prompt] * 2, params)]
    engine = Engine(cfg, w, ec, mesh=make_mesh(), plan=get_layout("dp8_ep8").replace(routing="replicate"))
    engine.add_request(list(range(30, 40)), SamplingParams(max_new_tokens=4))  # rank 0 busy: the group elsewhere
    assert run_forks(engine, prompt, params) == want and sum(engine.stats.tokens) == 10 + 3 + 10 + 2 * 4
