"""Smoke test of `python -m qwen35_lib.bench layouts`: runs end to end at tiny size and writes the JSON document.

Never asserts timings. Two stages only (each compiles a decode and a prefill step): the tensor-parallel baseline
and the last dp8_ep8 stage (replicate routing with both collective flags).
"""

import json

import pytest

from qwen35_lib.bench.__main__ import main
from qwen35_lib.bench.layouts import STAGE_NAMES, options


def test_layouts_smoke(tmp_path, capsys):
    out = tmp_path / "layouts.json"
    assert main(["layouts", "--quick", "--repeats", "1", "--settle", "0", "--stages", "baseline,hier_rs",
                 "--seqs", "8", "--prefill-seqs", "8", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"benchmark", "model", "devices", "mesh", "baseline", "batches", "stages", "speedup",
            "greedy_tokens_agree", "caveat", "environment", "command"} <= doc.keys()
    assert doc["devices"] == 8 and doc["mesh"] == {"chip": 4, "core": 2} and doc["baseline"] == "baseline"
    assert list(doc["stages"]) == ["baseline", "hier_rs"]
    base, hier = doc["stages"]["baseline"], doc["stages"]["hier_rs"]
    assert (base["layout"], base["ranks"], base["routing"]) == ("tp8_kvrep", 1, None)
    assert (hier["layout"], hier["ranks"], hier["routing"], hier["fuse_allgather"], hier["hierarchical_rs"]) == \
           ("dp8_ep8", 8, "replicate", True, True)
    for stage in doc["stages"].values():
        for batch in ("decode", "prefill"):
            assert {"D", "T", "median_s", "times_s", "tokens_per_s", "real_tokens"} <= stage[batch].keys()
        assert stage["speedup_vs_baseline"].keys() == {"decode", "prefill"}
    assert base["speedup_vs_baseline"] == {"decode": 1.0, "prefill": 1.0}
    assert set(doc["greedy_tokens_agree"]) == {"decode", "prefill"}
    assert "memory copies" in doc["caveat"] and "memory copies" in capsys.readouterr().out


def test_options_are_checked():
    class Args:
        quick, model, seqs, context, prefill_seqs, prefill_len = True, None, None, None, None, None
        stages = "baseline,nope"

    with pytest.raises(ValueError, match="nope"):
        options(Args())
    Args.stages = ",".join(STAGE_NAMES)
    assert options(Args())["stages"] == list(STAGE_NAMES)
