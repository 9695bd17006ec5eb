"""Kernels: each slot's implementations (XLA now, Pallas TPU later), selected through `registry`."""

from qwen35_lib.kernels.registry import SLOTS, available, for_plan, get, register

__all__ = ["SLOTS", "available", "for_plan", "get", "register"]
