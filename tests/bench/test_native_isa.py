"""bench.native_isa: the native kernels' ISA variants side by side in one process."""

import argparse

import pytest

from qwen35_lib.bench import native_isa
from qwen35_lib.kernels.native import build as native


def test_native_isa_runs_every_variant_interleaved():
    """`bench native-isa` on qwen3.5-tiny's shapes, once each: every variant here traced with its own handlers, the
    same outputs up to a rounding (GDN's dv = 24 is whole AVX2 vectors and AVX-512's scalar loop)."""
    if not native.host_isas() or native.compiler() is None:
        pytest.skip("no native variant runs here")
    doc = native_isa.run(argparse.Namespace(model="qwen3.5-tiny", isas="all", repeats=1, settle=0))
    assert doc["isas"] == list(native.host_isas())
    cases = ("moe decode", "moe prefill", "dense rows", "gdn decode", "gdn verify")
    assert {(r["case"], r["isa"]) for r in doc["results"]} == {(c, v) for c in cases for v in native.host_isas()}
    assert all(r["max_abs_diff"] < 1e-5 for r in doc["results"])
