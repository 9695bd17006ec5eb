"""The model as pure functions of (config, weights, inputs)."""

from qwen35_lib.model.decoder import check_weights, forward

__all__ = ["check_weights", "forward"]
