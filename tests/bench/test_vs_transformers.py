"""bench.vs_transformers: its shapes argument, and the benchmark against HF transformers end to end (tiny)."""

import json

import pytest

from qwen35_lib import get_config
from qwen35_lib.bench.__main__ import main
from qwen35_lib.bench.vs_transformers import check_same_model, parse_shapes


def test_parse_shapes():
    assert parse_shapes("1x512, 4X256") == [(1, 512), (4, 256)]
    for bad in ("", "512", "1x0", "axb"):
        with pytest.raises(ValueError):
            parse_shapes(bad)


def test_check_same_model_ignores_names_dtypes_and_eos_only():
    tiny = get_config("qwen3.5-tiny")
    check_same_model(tiny, tiny.replace(name="loaded", dtype="float32", eos_token_ids=(2,)))
    with pytest.raises(ValueError, match=r"loads as a different model than qwen3.5-tiny: \{'num_experts': \(8, 16\)\}"):
        check_same_model(tiny, tiny.replace(num_experts=16))


@pytest.mark.reference
def test_vs_transformers_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "vs.json"
    assert main(["vs-transformers", "--model", "qwen3.5-tiny", "--shapes", "1x16", "--repeats", "1",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["dtype"] == "float32" and doc["model"] == "qwen3.5-tiny"
    (shape,) = doc["shapes"]
    assert (shape["batch"], shape["seq"], shape["tokens"]) == (1, 16, 16)
    assert set(shape["tokens_per_s"]) == {"ours", "transformers"} and shape["speedup"] > 0
    assert shape["max_abs_logit_diff"] < 1e-4  # the same weights give the same logits
    assert doc["matmul_gflop_s"] > 0 and shape["matmul_roofline"]["flops"] > 0
    assert shape["matmul_roofline"]["ours"] > 0 and shape["matmul_roofline"]["transformers"] > 0
    rows = {r["component"]: r for r in shape["profile"]["rows"]}  # our forward, profiled, beside its floors
    assert rows["dense matmuls"]["ms"] > 0 and rows["dense matmuls"]["flops_ms"] > 0 and rows["MoE"]["floor_ms"] > 0
    assert "withhold_ratios" in doc["load"] and doc["ratios_withheld"] == doc["load"]["withhold_ratios"]
