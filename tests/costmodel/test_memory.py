"""costmodel.memory: the resident bytes against the stored TPU7x compiles, and the pools they price."""

from __future__ import annotations

import pytest

from qwen35_lib import costmodel, data
from qwen35_lib.aot import sweep
from qwen35_lib.costmodel import memory, specs
from qwen35_lib.plan import any_stage

# the sweep's documents (stage x step entries); tpu7x-8-mtp.json (verify steps) is judged by tests/aot/test_verify.py
STORED_FILES = sorted(p.name for p in data.path("aot").iterdir()
                      if p.suffix == ".json" and "stages" in data.read_json(f"aot/{p.name}"))


STORED_CASES = [(f, stage, step) for f in STORED_FILES for stage, e in data.read_json(f"aot/{f}")["stages"].items()
         for step in e["steps"]]


def test_there_are_stored_compiles_to_judge_against():
    assert len(STORED_CASES) >= 3, STORED_FILES


@pytest.mark.parametrize("name, stage, step", STORED_CASES)
def test_resident_bytes_match_the_compile(name, stage, step):
    doc = data.read_json(f"aot/{name}")
    compiled = doc["stages"][stage]["steps"][step]
    shape = doc["shape"]
    cfg = sweep.serving_config(doc["model"], groups=doc["groups"], **doc["overrides"])
    per_rank = -(-shape["requests"] // compiled["ranks"])
    model = memory.resident_bytes_per_device(cfg, specs.get("tpu7x-8"), any_stage(stage), per_rank,
                                             shape["context_len"], shape["kv_dtype"], shape["page_size"])
    for key, value in model.items():
        assert value == pytest.approx(compiled[key], rel=0.005), key


def test_the_resident_bytes_price_the_pools_for_requests(monkeypatch):
    # `resident_bytes_per_device` prices `CacheShape.for_requests` of its requests a rank over the plan's ranks:
    # the pools the AOT compiles and `placement` size (the FP8 pool as values: the bytes are the same as words)
    from qwen35_lib.engine.cache import CacheShape

    seen = []
    real = memory.traffic.resident_bytes
    monkeypatch.setattr(memory.traffic, "resident_bytes", lambda plan, cfg, cache: seen.append(
        (plan.dp, cache)) or real(plan, cfg, cache))
    cfg = costmodel.serving_model()
    for stage in ("baseline", "hier_rs"):
        memory.resident_bytes_per_device(cfg, specs.get("tpu7x-8"), any_stage(stage), 3, 9216,
                                         "float8_e4m3fn", 256)
    assert [ranks for ranks, _ in seen] == [1, 8]
    for ranks, cache in seen:
        assert cache == CacheShape.for_requests(3 * ranks, 9216, ranks=ranks, page_size=256, kv_dtype="float8_e4m3fn")
        assert (cache.num_pages, cache.num_slots) == (3 * 36 + 1, 4)
