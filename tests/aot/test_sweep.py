"""The ahead-of-time sweep (`python -m qwen35_lib.aot sweep`): its shapes, the usable HBM read from the TPU
compiler, and a resumable sweep of one stage of the tiny model compiled for TPU7x-8 (in a child process)."""

from __future__ import annotations

import pytest

from qwen35_lib.aot import sweep
from tests import aot_subprocess


def test_the_serving_shape_is_512_requests_with_whole_context_pools():
    s = sweep.SERVING
    assert (s.requests, s.context_len, s.page_size, s.kv_dtype) == (512, 9216, 256, "float8_e4m3fn")
    assert s.tokens("8k/1k decode", 8) == (64, 0) and s.tokens("1k/8k mixed", 8) == (64, 1024)
    assert s.tokens("8k/1k decode", 1) == (512, 0)  # a TP stage: all 512 in its one rank
    cfg = sweep.serving_config("qwen3.5-397b-a17b", groups=2)
    assert cfg.num_groups == 2 and cfg.expert_dtype == "float8_e4m3fn" and cfg.gdn_state_dtype == "bfloat16"


def _usable() -> int:
    return sweep.usable_bytes()


def _sweep_twice(path: str) -> list:
    run = lambda: sweep.sweep("qwen3.5-tiny", ["hier_rs"], groups=2, json_path=path, progress=False,
                              overrides={"expert_dtype": None},  # tiny widths are below the FP8 block
                              steps=["8k/1k decode", "1k/8k decode"],  # one program: same shapes
                              weight_layouts="default",  # at tiny widths XLA overrides 16 x 128 bf16 tiles
                              largest=False)  # the largest-pool search: test_largest_pool_* below, no compile
    first = run()
    again = run()  # resumed
    return [first, again, sweep.table(again)]


@pytest.fixture(scope="module")
def tpu7x(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "tiny.json"
    return aot_subprocess.run({"usable": (_usable,), "sweep": (_sweep_twice, str(path))})


@pytest.mark.tpu_compile
def test_the_usable_hbm_is_the_compilers_94_75_gib(tpu7x):
    from qwen35_lib import hardware

    assert tpu7x["usable"] == 101_737_037_824  # 94.75 * 2**30: XLA's "G" is GiB
    assert hardware.get("tpu7x-8").usable_hbm_bytes_per_device == tpu7x["usable"]  # where every fit is judged


@pytest.mark.tpu_compile
def test_a_stage_compiles_resumes_and_reports_its_memory(tpu7x):
    first, again, table = tpu7x["sweep"]
    assert again == first  # the second run compiled nothing new: every entry came from the file
    steps = first["stages"]["hier_rs"]["steps"]
    assert list(steps) == ["8k/1k decode", "1k/8k decode"]
    d = steps["8k/1k decode"]
    assert d["ranks"] == 8 and d["decode_tokens_per_rank"] == 64 and d["fits"]
    assert d["total_bytes"] == (d["argument_bytes"] + d["output_bytes"] - d["alias_bytes"] + d["temp_bytes"]
                                + d["code_bytes"])
    assert d["headroom_bytes"] == first["usable_bytes"] - d["total_bytes"]
    # the arguments are the weights and caches one device holds (+ the step's small inputs)
    resident = d["weight_bytes"] + d["kv_bytes"] + d["gdn_state_bytes"]
    assert resident <= d["argument_bytes"] <= 1.01 * resident + 2**20
    assert steps["1k/8k decode"]["same_program_as"] == "8k/1k decode"  # same pools, same shapes
    assert d["collectives"]["all-gather"]["count"] >= 1 and d["collectives_per_group"]
    # compiled (loop bodies times their trips) beside the closed form: bytes within 1%; the counts differ by the
    # sampler's next-token all-gather, which the TPU step runs as an all-reduce (the cost model: an all-gather)
    for kind in ("all-gather", "reduce-scatter"):
        c = d["collectives"][kind]
        assert c["bytes"] == pytest.approx(c["model_bytes"], rel=0.01), (kind, c)
    rs = d["collectives"]["reduce-scatter"]
    assert rs["count"] == rs["model_count"] == 2 * 2 * 4 * 2, rs  # 2 phases x 2 micro-batches x 4 layers x 2 groups
    assert "hier_rs    8k/1k decode" in table and "usable 94.75 GiB" in table


def test_largest_pool_is_the_last_page_count_that_fits(monkeypatch):
    """The search on a stand-in compile whose total grows by 1 MB a page per sequence (no TPU needed)."""
    usable, fixed, per_seq_page = 10**9, 400 * 10**6, 10**6
    seen = []

    def fake(cfg, stage, step, mesh, shape, *a):
        n = shape.context_len // shape.page_size
        seen.append(n)
        total = fixed + n * per_seq_page
        return {"total_bytes": total, "fits": total <= usable}

    monkeypatch.setattr(sweep, "compile_entry", fake)
    shape = sweep.ServingShape(requests=16, context_len=100 * 256)  # 2 sequences a rank on 8 ranks
    decode = {"ranks": 8, "fits": True, "kv_bytes": 2 * 100 * 10**6 // 2, "headroom_bytes": usable - 500 * 10**6}
    lp = sweep.largest_pool(None, "kernels", None, shape, usable, decode)
    assert lp["pages_per_seq"] == 600 and lp["exact"] and lp["tokens_per_seq"] == 600 * 256, (lp, seen)
    assert len(seen) <= 4, seen  # the headroom's guess, its correction from the measured total, the two bounds
    decode["headroom_bytes"] //= 3  # a wrong guess: found by bisection all the same
    assert sweep.largest_pool(None, "kernels", None, shape, usable, decode)["pages_per_seq"] == 600


def test_largest_pool_searches_down_from_a_refused_step(monkeypatch):
    """A stage whose step at the serving pool is refused (the baseline's): the search bisects below it."""
    usable, fixed, per_seq_page = 10**9, 400 * 10**6, 10**7

    def fake(cfg, stage, step, mesh, shape, *a):
        total = fixed + shape.context_len // shape.page_size * per_seq_page
        refused = {"fits": False, "error": "RESOURCE_EXHAUSTED"}
        return {"total_bytes": total, "fits": True} if total <= usable else refused

    monkeypatch.setattr(sweep, "compile_entry", fake)
    shape = sweep.ServingShape(requests=16, context_len=100 * 256)
    decode = {"ranks": 8, "fits": False, "kv_bytes": 2 * 100 * 10**6, "error": "RESOURCE_EXHAUSTED"}
    lp = sweep.largest_pool(None, "baseline", None, shape, usable, decode, max_compiles=12)
    assert lp["pages_per_seq"] == 60 and lp["exact"], lp


def test_the_sweeps_pools_are_for_requests_and_its_resident_bytes_their_abstract_caches_shards():
    # sweep.cache_shape is `CacheShape.for_requests` (the FP8 pool as words where the bound plan's attention keeps
    # it so: the XLA attention on a TPU); `resident` counts `abstract_cache`'s shards on the fullest device
    import math

    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    from qwen35_lib import get_config
    from qwen35_lib.engine.cache import CacheShape, abstract_cache
    from qwen35_lib.parallel.shardings import placed_config
    from qwen35_lib.plan import AXES, get_stage, make_mesh

    small = sweep.ServingShape(requests=10, context_len=40, page_size=8)
    tpu7x = AbstractMesh((4, 2), AXES)
    tpu = get_stage("hier_rs").bind(tpu7x, platform="tpu")
    assert sweep.cache_shape(small, tpu, tpu7x) == CacheShape.for_requests(
        10, 40, ranks=8, page_size=8, kv_dtype="float8_e4m3fn", kv_words=True)
    mesh, cfg = make_mesh(), get_config("qwen3.5-tiny")
    for stage in ("baseline", "hier_rs"):
        plan = get_stage(stage).bind(mesh, cfg)
        placed = placed_config(cfg, plan, mesh)
        shape = sweep.cache_shape(small, plan, mesh)
        assert shape == CacheShape.for_requests(10, 40, ranks=plan.dp_size(mesh), page_size=8,
                                                kv_dtype="float8_e4m3fn")  # CPU: the FP8 pool as it is
        cache = abstract_cache(placed, shape, plan, mesh)
        per_device = lambda names, cache=cache: max(
            sum(math.prod(cache[n].sharding.shard_shape(cache[n].shape)) * jnp.dtype(cache[n].dtype).itemsize
                for n in names if d in cache[n].sharding.device_set) for d in jax.devices())
        got = sweep.resident(placed, plan, small, mesh)
        assert got["kv_bytes"] == per_device(["kv", "kv_scale"]) > 0
        assert got["gdn_state_bytes"] == per_device([n for n in cache if n not in ("kv", "kv_scale")]) > 0
