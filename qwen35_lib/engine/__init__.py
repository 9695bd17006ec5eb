"""The serving engine: paged KV cache, GDN state slots, ragged mixed batches, continuous batching, sampling."""

from qwen35_lib.engine.engine import Engine
from qwen35_lib.engine.engine_config import EngineConfig
from qwen35_lib.engine.requests import Result
from qwen35_lib.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "Result", "SamplingParams"]
