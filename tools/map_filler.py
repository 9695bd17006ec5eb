"""pytest plugin for tools/crash_repro.sh: start the test process with all but HEADROOM of vm.max_map_count used.

A long test worker holds one code, one constant and one data mapping per XLA:CPU kernel of every program jax still
caches; at vm.max_map_count (65530 by default) the next compile's mmap fails and LLVM aborts the process ("LLVM ERROR:
Unable to allocate section memory!", issue 16). Re-running a whole worker's history takes half an hour; instead this
plugin maps anonymous pages (held to the end, never touched) until only CRASH_REPRO_HEADROOM mappings are left, so
that the compiles of the few modules that follow decide whether the process survives. It prints the mapping count at
every module boundary.

    python -m pytest -p tools.map_filler tests/model/test_decoder.py tests/model/test_ragged.py
"""

from __future__ import annotations

import mmap
import os
import pathlib

import pytest

HEADROOM = int(os.environ.get("CRASH_REPRO_HEADROOM", "6000"))
_held: list[mmap.mmap] = []


def map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def pytest_sessionstart(session) -> None:
    limit = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    while map_count() < limit - HEADROOM:  # each shared anonymous map is its own mapping (they never merge)
        _held.extend(mmap.mmap(-1, mmap.PAGESIZE) for _ in range(min(1000, limit - HEADROOM - map_count())))
    print(f"map_filler: {map_count()} of vm.max_map_count {limit} mappings in use, {len(_held)} of them held")


@pytest.fixture(autouse=True, scope="module")
def _print_map_count(request):
    yield
    print(f"\nmap_filler: {map_count()} mappings after {request.node.nodeid}")
