"""The engine's API refuses bad arguments at the door, and a cache that cannot fit before allocating it.

Every case is decided when a request is queued or an engine is built, except the step's own working memory: a
bucket's step is compiled and checked before it first runs.
"""

import dataclasses
import resource

import numpy as np
import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
from qwen35_lib.engine import cache as cache_module
from qwen35_lib.engine.cache import CacheShape, device_cache_bytes, memory_shortfall
from qwen35_lib.plan import get_layout, make_mesh

EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, page_size=8, max_model_len=64)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    return cfg, init_weights(cfg, 0)


@pytest.fixture
def engine(tiny):
    return Engine(*tiny, EC)


# --- SamplingParams ---------------------------------------------------------------------------------------------


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


# --- prompts ----------------------------------------------------------------------------------------------------


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


# --- generate checks everything before queueing anything -------------------------------------------------------


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


# --- memory is checked before it is spent -----------------------------------------------------------------------


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
    engine = Engine(*tiny, EC)
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
    fresh = Engine(*tiny, EC).generate(prompts, params)
    assert [engine.results[i].output_ids for i in range(2)] == [r.output_ids for r in fresh]


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


# --- abort ------------------------------------------------------------------------------------------------------


def test_abort_request_frees_its_pages_and_slot(engine):
    """A queued request is dropped; a running one gives back its pages and slot (the server's disconnect)."""
    sched = engine.ranks[0]
    pages, slots = len(sched.free_pages), len(sched.free_slots)
    a = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    b = engine.add_request([4, 5], SamplingParams(max_new_tokens=4))
    plan = sched.plan()  # a admitted (the thrash guard may hold b back): pages and a slot taken
    sched.commit(plan, [0] * len(plan.items))
    assert sched.running[0].id == a and len(sched.free_pages) < pages and len(sched.free_slots) < slots
    assert engine.abort_request(b) and engine.abort_request(a) and not engine.has_work  # queued or running
    assert (len(sched.free_pages), len(sched.free_slots)) == (pages, slots)
    assert not engine.abort_request(a) and a not in engine.results  # gone, with no result
