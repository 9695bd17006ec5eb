"""The cost model's closed-form temporaries (`costmodel.temporaries`) against the TPU7x compile's `temp_bytes`, from
the stored sweep (`qwen35_lib/data/aot/tpu7x-8.json`, written by `python -m qwen35_lib.aot sweep`): within 25%
for every step the file holds that compiled with memory to spare (issue 12, item 6; a step that fits with little
headroom may have temporaries set by the memory limit, not by the program). The estimate never reads the file's
numbers: only its shapes. And how a refusal is read: the compiler's "HLO temporaries (N G)" is the program's whole
footprint, arguments included (issue 31)."""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh

from qwen35_lib import budget, data
from qwen35_lib.aot import sweep
from qwen35_lib.config import get_config
from qwen35_lib.costmodel import temporaries, traffic
from qwen35_lib.engine.cache import CacheShape
from qwen35_lib.plan import AXES, get_stage
from tests import aot_subprocess

DOC = data.read_json("aot/tpu7x-8.json")
# A step compiled with less than this share of the usable HBM to spare is not judged: its temporaries may be what
# the memory limit left (the XLA stages dp_ep to hier_rs, 1.0-2.6 GB to spare), not what the program needs.
AMPLE = 0.05


def _ample(entry: dict) -> bool:
    return entry.get("headroom_bytes", 0) >= AMPLE * DOC["usable_bytes"]


# the kernels decode step since its projections read the stacks in place and its routing gathers rows once (issue
# 50): compiled 0.58 GB (was 1.13), the table's parts 0.32 GB (sampling 0.19, routed rows 0.09, GDN state and the
# per-layer vectors' slices 0.03); the rest is not yet attributed
UNEXPLAINED = {("kernels", "8k/1k decode"): "0.58 GB compiled, 0.32 GB of it in the table's parts (issue 50)"}
CASES = [pytest.param(stage, step, marks=[pytest.mark.xfail(strict=True, reason=UNEXPLAINED[stage, step])]
                      if (stage, step) in UNEXPLAINED else [])
         for stage, s in DOC["stages"].items() for step, e in s["steps"].items()
         if "temp_bytes" in e and "same_program_as" not in e and _ample(e)]


def _estimate(stage: str, entry: dict) -> dict:
    shape = DOC["shape"]
    plan = get_stage(stage).bind(AbstractMesh((4, 2), AXES), platform="tpu")  # tpu7x:2x2x1: 4 chips x 2 cores
    cfg = sweep.serving_config(DOC["model"], DOC["groups"], **DOC["overrides"])
    R = entry["ranks"]
    step = traffic.StepShape.of_compile(cfg, R, shape["requests"], entry["decode_tokens_per_rank"],
                                        entry["prefill_tokens_per_rank"])
    cache = CacheShape.for_requests(shape["requests"], shape["context_len"], ranks=R, page_size=shape["page_size"],
                                    kv_dtype=shape["kv_dtype"])
    return temporaries.step_temporaries(plan, cfg, step, cache)


def test_the_stored_sweep_holds_compiled_steps_to_judge_against():
    assert DOC.get("weight_layouts") == "mxu" and CASES, (DOC.get("weight_layouts"), CASES)
    judged = {(c.values[0], c.values[1].split()[1]) for c in CASES}
    assert {("kernels", "decode"), ("kernels", "mixed")} <= judged, judged


@pytest.mark.parametrize("stage, step", CASES)
def test_the_estimate_is_within_25_percent_of_the_compile(stage, step):
    entry = DOC["stages"][stage]["steps"][step]
    est = _estimate(stage, entry)
    assert est["total"] == pytest.approx(entry["temp_bytes"], rel=0.25), (est, entry["temp_bytes"])


def test_in_place_experts_are_not_charged_and_copied_ones_are():
    entry = next(e for s in DOC["stages"].values() for e in s["steps"].values())
    pallas = _estimate("kernels", entry)["weight_slices"]
    xla = _estimate("hier_rs", entry)["weight_slices"]  # the XLA MoE: each group's FP8 experts copied + bf16
    assert xla > pallas + 1e9, (xla, pallas)


def test_a_refusal_is_read_as_the_whole_footprint():
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (101.20G) "
           "exceeds available HBM (94.75G).")
    assert temporaries.refused_bytes(msg) == 101.20 * 2**30
    assert temporaries.refused_temporaries(msg, 100 * 2**30) == pytest.approx(1.20 * 2**30)
    assert temporaries.refused_bytes("INTERNAL: something else") is None


def _weights_only(spread: str) -> dict:
    """In the child process: notebook 00's program of the 397B model's bf16 weights spread as `spread`."""
    cfg = get_config("qwen3.5-397b-a17b").replace(gdn_state_dtype="bfloat16")  # bf16 experts, as the checkpoint
    compiled = budget.compiled_weight_bytes(cfg, spread)
    return dict(error=compiled.error, compiled=compiled.argument_bytes_per_device,
                arguments=budget.weight_bytes_per_device(cfg, 8, spread))


@pytest.mark.tpu_compile
def test_a_weights_only_program_is_refused_with_its_argument_bytes():
    """Notebook 00's program of the 397B model's bf16 weights, every weight but the routed experts replicated
    (`experts_sharded`), holds nothing but its arguments, and the compiler refuses it naming "HLO temporaries"
    equal to those arguments within 1%. So the refusal's figure is the program's whole footprint, not its
    temporaries."""
    got = aot_subprocess.run({"experts_sharded": (_weights_only, "experts_sharded")})["experts_sharded"]
    assert got["error"] is not None, f"not refused: {got}"
    refused = temporaries.refused_bytes(got["error"])
    assert refused is not None, got["error"]
    assert refused == pytest.approx(got["arguments"], rel=0.01), got
