"""The ahead-of-time sweep (`python -m qwen35_lib.aot sweep`): its shapes, the usable HBM read from the TPU
compiler, and a resumable sweep of one stage of the tiny model compiled for TPU7x-8 (in a child process)."""

from __future__ import annotations

import pytest

from qwen35_lib.aot import sweep
from tests import aot_subprocess


def test_the_serving_shape_is_512_requests_with_whole_context_pools():
    s = sweep.SERVING
    assert (s.requests, s.context_len, s.page_size, s.kv_dtype) == (512, 9216, 256, "float8_e4m3fn")
    assert s.tokens("8k/1k decode", 8) == (64, 0) and s.tokens("1k/8k mixed", 8) == (63, 1024)
    assert s.tokens("8k/1k decode", 1) == (512, 0)  # a TP stage: all 512 in its one rank
    cfg = sweep.serving_config("qwen3.5-397b-a17b", groups=2)
    assert cfg.num_groups == 2 and cfg.expert_dtype == "float8_e4m3fn" and cfg.gdn_state_dtype == "bfloat16"


def _usable() -> int:
    return sweep.usable_bytes()


def _sweep_twice(path: str) -> list:
    run = lambda: sweep.sweep("qwen3.5-tiny", ["hier_rs"], groups=2, json_path=path, progress=False,
                              overrides={"expert_dtype": None},  # tiny widths are below the FP8 block
                              steps=["8k/1k decode", "1k/8k decode"])  # one program: same shapes
    first = run()
    again = run()  # resumed
    return [first, again, sweep.table(again)]


@pytest.fixture(scope="module")
def tpu7x(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "tiny.json"
    return aot_subprocess.run({"usable": (_usable,), "sweep": (_sweep_twice, str(path))})


@pytest.mark.tpu_compile
def test_the_usable_hbm_is_the_compilers_94_75_gib(tpu7x):
    from qwen35_lib import hardware

    assert tpu7x["usable"] == 101_737_037_824  # 94.75 * 2**30: XLA's "G" is GiB
    assert hardware.get("tpu7x-8").usable_hbm_bytes_per_device == tpu7x["usable"]  # where every fit is judged


@pytest.mark.tpu_compile
def test_a_stage_compiles_resumes_and_reports_its_memory(tpu7x):
    first, again, table = tpu7x["sweep"]
    assert again == first  # the second run compiled nothing new: every entry came from the file
    steps = first["stages"]["hier_rs"]["steps"]
    assert list(steps) == ["8k/1k decode", "1k/8k decode"]
    d = steps["8k/1k decode"]
    assert d["ranks"] == 8 and d["decode_tokens_per_rank"] == 64 and d["fits"]
    assert d["total_bytes"] == (d["argument_bytes"] + d["output_bytes"] - d["alias_bytes"] + d["temp_bytes"]
                                + d["code_bytes"])
    assert d["headroom_bytes"] == first["usable_bytes"] - d["total_bytes"]
    # the arguments are the weights and caches one device holds (+ the step's small inputs)
    resident = d["weight_bytes"] + d["kv_bytes"] + d["gdn_state_bytes"]
    assert resident <= d["argument_bytes"] <= 1.01 * resident + 2**20
    assert steps["1k/8k decode"]["same_program_as"] == "8k/1k decode"  # same pools, same shapes
    assert d["collectives"]["all-gather"]["count"] >= 1 and d["collectives_per_group"]
    assert "hier_rs    8k/1k decode" in table and "usable 94.75 GiB" in table
