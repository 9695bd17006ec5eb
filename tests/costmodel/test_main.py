"""`python -m qwen35_lib.costmodel predict --json`: the command line's JSON contract."""

from __future__ import annotations

import json
import math
import subprocess
import sys


def test_cli_predict_json():
    out = subprocess.run([sys.executable, "-m", "qwen35_lib.costmodel", "predict", "--model", "qwen3.5-397b-a17b",
                          "--hardware", "tpu7x-8", "--stage", "fused_ag", "--isl", "1024", "--osl", "512",
                          "--concurrency", "32", "--json"], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert doc["stage"] == "fused_ag" and doc["fits"] and doc["layout"] == "dp8_ep8"
    assert math.isfinite(doc["output_tokens_per_s"]) and math.isfinite(doc["total_tokens_per_s"])
