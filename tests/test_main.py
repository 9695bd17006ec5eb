"""`python -m qwen35_lib info`, the hardware table and the HBM budget behind it. The CLI runs in this process
(`main`, as `python -m` calls it); `test_text_output` starts the module entry point itself."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

from qwen35_lib import budget, hardware
from qwen35_lib.__main__ import main
from qwen35_lib.config import get_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 2**30


def info(*args: str) -> subprocess.CompletedProcess:
    """`info ARGS` through `main`, in this process: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["info", *args])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return subprocess.CompletedProcess(["info", *args], code, out.getvalue(), err.getvalue())


def info_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m qwen35_lib info ARGS` in a process of its own."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "qwen35_lib", "info", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def info_json(*args: str) -> dict:
    out = info(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_397b_counts_and_fit_on_tpu7x():
    r = info_json("--model", "qwen3.5-397b-a17b", "--hardware", "tpu7x-8", "--expert-dtype", "float8_e4m3fn",
                  "--gdn-state-dtype", "bfloat16", "--concurrency", "512", "--context-len", "8192")
    assert r["total_params"] == 396_346_350_336
    assert r["active_params"] == 17_349_040_896
    assert sum(r["params_by_part"].values()) == r["total_params"]
    assert sum(r["active_params_by_part"].values()) == r["active_params"]
    assert r["kv_bytes_per_token"] == 2 * 15 * 2 * 256 * 2  # K and V, 15 attention layers, 2 KV heads of 256, bf16
    assert r["gdn_state_bytes_per_seq"] == 45 * (64 * 128 * 128 + 12288 * 3) * 2  # recurrent + conv, bf16
    assert r["weight_bytes_by_dtype"]["float8_e4m3fn"] == 386_547_056_640
    assert r["hardware"]["devices"] == 8 and r["hardware"]["hbm_bytes_per_device"] == 96 * GiB
    b = r["budget"]
    assert b["weights_fit"] and b["fits"] and b["left_bytes"] > 0
    assert b["kv_cache_bytes"] == 512 * 8192 * r["kv_bytes_per_token"]
    assert b["max_concurrency"] >= 512


def test_qwen3_next_80b_counts():
    r = info_json("--model", "qwen3-next-80b-a3b")
    assert (r["total_params"], r["active_params"]) == (79_674_391_296, 3_874_929_408)
    assert "budget" not in r


def test_text_output():
    out = info_process("--model", "qwen3.5-397b-a17b", "--hardware", "tpu7x-8")
    assert out.returncode == 0, out.stderr
    assert "396,346,350,336" in out.stdout and "17,349,040,896" in out.stdout and "tpu7x-8" in out.stdout


def test_bf16_weights_squeeze_in_but_leave_no_room_for_512_requests():
    bf16 = get_config("qwen3.5-397b-a17b", gdn_state_dtype="bfloat16")
    b = budget.hbm_budget(bf16, "tpu7x-8", concurrency=512, context_len=1024)
    assert b.weights_fit and not b.fits
    assert b.free_bytes < b.gdn_state_bytes  # the GDN state alone does not fit
    fp8 = bf16.replace(expert_dtype="float8_e4m3fn")
    assert budget.hbm_budget(fp8, "tpu7x-8", concurrency=512, context_len=8192).fits
    # replicating everything but the routed experts (dp8_ep8) costs 7 extra copies of the dense weights
    even = budget.hbm_budget(bf16, "tpu7x-8")
    rep = budget.hbm_budget(bf16, "tpu7x-8", spread="experts_sharded")
    dense = even.weight_bytes - budget.routed_expert_bytes(bf16)
    assert rep.weight_bytes_on_devices - even.weight_bytes_on_devices == pytest.approx(7 * dense, abs=16)
    assert not rep.weights_fit


def test_does_not_fit_is_reported():
    r = info_json("--model", "qwen3.5-397b-a17b", "--hardware", "h200")
    assert not r["budget"]["weights_fit"] and not r["budget"]["fits"]
    assert r["budget"]["max_kv_tokens"] == 0 and r["budget"]["max_concurrency"] == 0
    out = info("--model", "qwen3.5-397b-a17b", "--hardware", "v6e-8")
    assert out.returncode == 0 and "DO NOT FIT" in out.stdout


def test_unknown_model_and_hardware():
    out = info("--model", "qwen9")
    assert out.returncode == 2 and "unknown model 'qwen9'" in out.stderr and "qwen3.5-397b-a17b" in out.stderr
    out = info("--model", "qwen3.5-tiny", "--hardware", "tpu99")
    assert out.returncode == 2 and "unknown hardware 'tpu99'" in out.stderr and "tpu7x-8" in out.stderr
    with pytest.raises(ValueError, match="unknown hardware"):
        hardware.get("tpu99")


def test_info_reads_a_checkpoint_directory(tmp_path):
    pytest.importorskip("transformers")
    from qwen35_lib import testing

    model = testing.make_hf_model("qwen3_5_moe", seed=0)
    testing.save_hf_checkpoint(model, tmp_path / "ckpt", form="per_expert")
    r = info_json("--model", str(tmp_path / "ckpt"))
    assert r["total_params"] == sum(p.numel() for p in model.parameters())
