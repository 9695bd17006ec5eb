"""costmodel.compiled: the model's FLOPs and HBM bytes beside the one-group TPU7x-8 compiles of every ladder stage
(data/aot/tpu7x-8-g1.json: `python -m qwen35_lib.aot sweep --groups 1 --no-largest-pool`)."""

import pytest

from qwen35_lib import data
from qwen35_lib.costmodel import compiled
from qwen35_lib.plan import LADDER

DOC = data.read_json("aot/tpu7x-8-g1.json")
DP_STAGES = [s for s in LADDER if s != "baseline"]


@pytest.fixture(scope="module")
def rows():
    return {(r["stage"], r["step"]): r for r in compiled.compare(DOC)}


def test_every_stage_has_a_one_group_decode_compile(rows):
    assert DOC["groups"] == 1
    assert {s for s, step in rows if step == "decode"} == set(LADDER)


@pytest.mark.parametrize("stage", DP_STAGES)
def test_the_flops_are_the_compiles_once_ragged_dot_is_counted_as_xla_counts_it(rows, stage):
    # XLA's cost analysis counts every gathered row of the grouped matmul against the device's experts; the rest
    # of the step is the model's own FLOPs; decode and, where compiled, the mixed step (1,024 prefill tokens a rank)
    for step in ("decode", "mixed"):
        r = rows.get((stage, step))
        assert r or step == "mixed"
        if r:
            assert r["flops_ratio"] == pytest.approx(1.0, abs=0.05), compiled.table([r])


@pytest.mark.xfail(strict=True, reason="the TP baseline's decode: model 291.0 GFLOP against XLA's 328.6 (x0.89), "
                   "not yet explained")
def test_the_baseline_flops_are_the_compiles(rows):
    assert rows[("baseline", "decode")]["flops_ratio"] == pytest.approx(1.0, abs=0.05)


def test_the_kernels_stage_is_read_through_its_xla_twin(rows):
    k, twin = rows[("kernels", "decode")], rows[("hier_rs", "decode")]
    assert k["compared_with"] == "hier_rs"
    assert (k["xla_bytes"], k["model_bytes"]) == (twin["xla_bytes"], twin["model_bytes"])


def test_a_full_depth_sweep_is_refused():
    with pytest.raises(ValueError, match="one-group sweep"):
        compiled.compare(dict(DOC, groups=15))


@pytest.mark.xfail(strict=True, reason="issue 30 item 4: the model's decode HBM bytes are 0.03x (baseline) to 0.14x "
                   "(the DP stages: 21.4 GB against 153.9 GB; the HLO text's own sum 77.1 GB) of XLA's count: the XLA "
                   "FP8 dequantization, the GDN state in float32 and the KV pool relayouts are not charged "
                   "(costmodel.compiled)")
@pytest.mark.parametrize("stage", LADDER)
def test_decode_hbm_bytes_within_25_percent(rows, stage):
    assert abs(rows[(stage, "decode")]["bytes_ratio"] - 1) <= compiled.DECODE_BYTES_TOLERANCE


def test_the_text_accounts_for_the_lm_head_as_the_model_does(rows):
    # the one block with no XLA-path extras: one device's [V/8 or V, D] head read once, both ways
    r = rows[("fused_ag", "decode")]
    assert r["text_bytes_by_block"]["lm_head"] == pytest.approx(r["model_bytes_by_block"]["lm_head"], rel=0.02)
