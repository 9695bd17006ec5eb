"""`python -m qwen35_lib.bench kernels`: runs end to end at a tiny size and writes valid JSON (no timings judged)."""

import json

from qwen35_lib.bench.__main__ import main
from qwen35_lib.kernels.gdn import native as gdn_native
from qwen35_lib.kernels.native import build as native


def test_kernels_smoke(tmp_path):
    out, choice = tmp_path / "kernels.json", tmp_path / "choice.json"
    assert main(["kernels", "--model", "qwen3.5-tiny", "--tokens", "8", "--dtypes", "float32", "--repeats", "1",
                 "--tile-sweep", "16", "--gdn-prefill-tokens", "70", "--gdn-decode-batch", "2",
                 "--json", str(out), "--write-choice", str(choice)]) == 0
    doc = json.loads(out.read_text())
    assert {"cases", "implementations", "wins", "overall", "environment"} <= set(doc)
    case = doc["cases"][0]
    assert case["tokens"] == 8 and case["dtype"] == "float32" and case["winner"] in doc["implementations"]
    assert set(case["median_ms"]) == set(doc["implementations"]) | {"tiled m=16", "dense (all experts)",
                                                                     "dense matmul (equal FLOPs)"}
    assert max(case["max_abs_diff_vs_ragged_dot"].values()) < 1e-5  # every candidate computes the same thing
    assert json.loads(choice.read_text())["overall"] == doc["overall"]
    # off a TPU the Pallas kernels are checked in interpret mode, never timed; every timed one has a ratio
    assert "pallas" not in doc["implementations"] and doc["numerics_only"] == ["pallas", "megablox gmm"]
    assert set(doc["throughput_ratio_vs_dense"]) == set(doc["implementations"]) | {"tiled m=16"}
    assert doc["default_implementation"] in doc["implementations"] and doc["acceptance"]["tokens"] == 8
    # the attention and GDN sections: Pallas (labelled interpret mode) and the CPU's kernels (attention by items, the
    # GDN's native ones where they build) next to their XLA twin, computing the same
    native_gdn = {"native"} if native.load(gdn_native.LIBRARY) is not None else set()
    for slot, impls in (("attention", {"xla", "items", "pallas"}), ("gdn", {"xla", "pallas"} | native_gdn)):
        rows = doc[slot]["rows"]
        assert rows and {r["implementation"] for r in rows} == impls, slot
        for r in rows:
            assert r["median_ms"] > 0 and (r["implementation"] in ("xla", "items", "native")
                                           or "interpret" in r["mode"]), r
            assert r["max_abs_diff_vs_xla"] < 2e-2, r  # bf16 (the tiny model's dtype): one rounding of O(1) outputs
