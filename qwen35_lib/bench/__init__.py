"""Benchmarks: scripts that measure side by side and write JSON results (never timed assertions).

`python -m qwen35_lib.bench NAME [--json PATH] ...`. Each benchmark is a module listed in `BENCHMARKS` with:
- `DESCRIPTION`: one line for `--help`;
- `add_arguments(parser)`: its own options (`--json` and `--repeats` are added for every benchmark);
- `run(args) -> dict`: measures, prints its table to stdout, returns the JSON document.
Shared timing rules and helpers live in `qwen35_lib.bench.timing`.
"""

from __future__ import annotations

import importlib
import pathlib
from types import ModuleType

BENCHMARKS: dict[str, str] = {
    "vs-transformers": "qwen35_lib.bench.vs_transformers",
    "kernels": "qwen35_lib.bench.kernels",
    "engine": "qwen35_lib.bench.engine",
    "costmodel": "qwen35_lib.bench.costmodel",
    "layouts": "qwen35_lib.bench.layouts",
    "serve": "qwen35_lib.bench.serve",
    "serve-stress": "qwen35_lib.bench.serve_stress",
    "native-isa": "qwen35_lib.bench.native_isa",
    "mtp": "qwen35_lib.bench.mtp",
}
RESULTS_DIR = pathlib.Path("build/bench")  # default `--json` folder, relative to the working directory


def load(name: str) -> ModuleType:
    """The module of benchmark `name`."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
    return importlib.import_module(BENCHMARKS[name])


def default_json_path(name: str) -> pathlib.Path:
    return RESULTS_DIR / f"{name.replace('-', '_')}.json"


__all__ = ["BENCHMARKS", "default_json_path", "load"]
