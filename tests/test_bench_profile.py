"""`python -m qwen35_lib.bench NAME --profile DIR` writes a jax.profiler trace (`generate --profile`'s helper)."""

import json

from qwen35_lib.bench.__main__ import main


def test_bench_profile_writes_a_trace(tmp_path):
    """The cheapest benchmark (kernels: one MoE case of the tiny model, no other section) under --profile."""
    out, prof = tmp_path / "kernels.json", tmp_path / "prof"
    assert main(["kernels", "--model", "qwen3.5-tiny", "--tokens", "8", "--dtypes", "float32", "--repeats", "1",
                 "--settle", "0", "--no-dense", "--no-interpret-check", "--no-attention", "--no-gdn",
                 "--json", str(out), "--profile", str(prof)]) == 0
    assert json.loads(out.read_text())["cases"]
    traces = list(prof.glob("plugins/profile/*/*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
