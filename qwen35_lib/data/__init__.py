"""The data files the library reads, shipped inside the package (a non-editable `pip install .` has them):
hardware.json, costmodel_hardware.json, workloads.json, published.json, costmodel_validation.json,
kernel_choice_cpu.json, recipes.json, moe_layer_measured.json, and the ahead-of-time sweeps in aot/ (tpu7x-8.json at
full depth, the HLO texts of its decode steps in aot/hlo/ for `costmodel.compiled`; aot/port/: the porting
notebook's models). The repository's `data/` is a link to this folder.

`path(name)` is where each is read (and where the benchmarks that measure them write): `$QWEN35_DATA_DIR/name`
when that variable names a folder holding it, else the package's own copy.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib

DATA_ENV = "QWEN35_DATA_DIR"  # a folder whose files replace the package's (your own hardware.json, ...)


def path(name: str) -> pathlib.Path:
    folder = os.environ.get(DATA_ENV)
    if folder and (pathlib.Path(folder) / name).is_file():
        return pathlib.Path(folder) / name
    return pathlib.Path(str(importlib.resources.files(__name__).joinpath(name)))


def read_json(name: str):
    p = path(name)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"data file {p} is missing: reinstall qwen35-playbook, or unset {DATA_ENV}") from None
