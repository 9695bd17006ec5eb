"""`python -m qwen35_lib generate --layout dp_ep | tp_kvrep` on 2 and 4 devices gives the single-device greedy tokens.

Two runs are subprocesses that make their own simulated devices (`--devices 2`, and `$QWEN35_DEVICES=4`); the
others run `main` in this process on the first devices of the test's 8 (no second process start).
Every run takes two step buckets (a compile each): all prompts prefill in the first step (4 x one 64-token GDN chunk
fit --max-num-batched-tokens 256), then decode steps, where 64 would have prefilled one prompt per step through six.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.__main__ import main
from qwen35_lib.cli_generate import RANDOM_WEIGHTS_SEED
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = [[3, 4, 5], [7, 8], [200, 9, 31, 77, 2, 6], [11]]
FLAGS = [a for p in PROMPTS for a in ("--prompt-ids", " ".join(map(str, p)))] + [
    "--max-new-tokens", "4", "--dtype", "float32", "--json", "--ignore-eos", "--max-num-seqs", "4",
    "--max-num-batched-tokens", "256", "--page-size", "8", "--max-model-len", "64"]


@pytest.fixture(scope="module")
def single_tokens() -> list[list[int]]:
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, page_size=8, max_model_len=64)
    results = Engine(cfg, init_weights(cfg, RANDOM_WEIGHTS_SEED), ec).generate(
        PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True))
    return [r.output_ids for r in results]


def _subprocess(*args: str, **env: str) -> dict:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    out = subprocess.run([sys.executable, "-m", "qwen35_lib", "generate", *FLAGS, *args], cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **env},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("layout,devices,how", [("dp_ep", 2, "flag"), ("tp_kvrep", 4, "env")])
def test_cli_general_layout_in_a_process_of_its_own(layout, devices, how, single_tokens):
    doc = _subprocess("--layout", layout, *(["--devices", str(devices)] if how == "flag" else []),
                      **({"QWEN35_DEVICES": str(devices)} if how == "env" else {}))
    assert doc["devices"] == devices and doc["engine"]["ranks"] == (devices if layout == "dp_ep" else 1)
    assert [r["output_ids"] for r in doc["requests"]] == single_tokens


@pytest.mark.parametrize("layout,devices", [("dp_ep", 4)])  # tp_kvrep under the CLI: the $QWEN35_DEVICES case
def test_cli_general_layout_on_the_first_devices(layout, devices, single_tokens, capsys):
    assert main(["generate", *FLAGS, "--layout", layout, "--devices", str(devices)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["devices"] == devices and doc["engine"]["ranks"] == (devices if layout == "dp_ep" else 1)
    assert [r["output_ids"] for r in doc["requests"]] == single_tokens


def test_cli_eight_device_name_on_another_count_names_the_general_one(capsys):
    assert main(["generate", "--prompt-ids", "1", "--layout", "dp8_ep8", "--devices", "4"]) == 2
    assert "use layout 'dp_ep'" in capsys.readouterr().err


def test_cli_general_layout_takes_every_device_present(single_tokens):
    """A general layout on a backend of 4 devices runs on all 4 without --devices (issue 32, item 3)."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    doc = _subprocess("--layout", "dp_ep", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=4".strip())
    assert doc["devices"] == 4 and doc["engine"]["ranks"] == 4
    assert [r["output_ids"] for r in doc["requests"]] == single_tokens
