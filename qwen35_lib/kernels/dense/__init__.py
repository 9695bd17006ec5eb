"""The `dense` slot: the projections (`xla`: XLA's dot; `pallas`: the TPU's, reading stacks in place; `native`: the
CPU's few-row handler over panel-packed weights). The model calls `linear` and `pack` (`forms`), whatever the form."""

from qwen35_lib.kernels.dense.forms import linear, pack

__all__ = ["linear", "pack"]
