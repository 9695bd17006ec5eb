"""qwen35_lib: serving Qwen3.5-397B-A17B on TPU7x, as a library the playbook's notebooks call.

Public API: `Config`, `get_config`, `from_hf_config`, `init_weights`, `abstract_weights`, `forward`,
`load_hf_checkpoint`, `model_stats`.
"""

from qwen35_lib.config import PRESETS, Config, from_hf_config, get_config
from qwen35_lib.parallel.parallelism import forward
from qwen35_lib.stats import model_stats
from qwen35_lib.weights import abstract_weights, init_weights


def load_hf_checkpoint(path, **kwargs):
    """`(config, weights)` from an HF checkpoint directory; see `qwen35_lib.checkpoint.load_hf_checkpoint`."""
    from qwen35_lib.checkpoint import load_hf_checkpoint as load

    return load(path, **kwargs)


__all__ = ["PRESETS", "Config", "abstract_weights", "forward", "from_hf_config", "get_config", "init_weights",
           "load_hf_checkpoint", "model_stats"]
