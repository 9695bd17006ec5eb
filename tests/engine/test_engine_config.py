"""engine.engine_config: the knobs refuse what cannot serve one request, and `check_cache_memory` names the knobs to
lower when the pools they ask for exceed the memory (the engine's own refusals: test_engine.py)."""

import pytest

from qwen35_lib import get_config
from qwen35_lib.engine import cache as cache_module
from qwen35_lib.engine.engine_config import EngineConfig, check_cache_memory


def test_engine_config_that_cannot_hold_one_request():
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=160"):
        _ = EngineConfig(max_model_len=160, page_size=8, num_pages=10).pages
    with pytest.raises(ValueError, match="EngineConfig.max_num_seqs must be >= 1, got 0"):
        EngineConfig(max_num_seqs=0)


def test_check_cache_memory_names_the_knobs_to_lower(monkeypatch):
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    monkeypatch.setattr(cache_module, "available_bytes", lambda d: (16 * 2**30, "host RAM, MemAvailable"))
    small, large = EngineConfig(max_model_len=64), EngineConfig(max_model_len=10_000_000)
    check_cache_memory(cfg, small, small.cache_shape())  # fits: nothing raised
    with pytest.raises(ValueError, match=r"GiB is free .*: lower max_num_seqs \(8\) or max_model_len \(10000000\)"):
        check_cache_memory(cfg, large, large.cache_shape())
    pinned = EngineConfig(num_pages=5_000_001)
    with pytest.raises(ValueError, match=r"lower num_pages \(5000001\), or use kv_dtype='float8_e4m3fn'$"):
        check_cache_memory(cfg, pinned, pinned.cache_shape())
