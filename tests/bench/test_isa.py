"""bench.isa (`--native-isa`): the variants it runs, each child's command line, and the side-by-side table from the
children's JSON documents (the children faked: no benchmark runs here)."""

import json
import subprocess

import pytest

from qwen35_lib.bench import isa
from qwen35_lib.bench.__main__ import build_parser
from qwen35_lib.kernels.native import build as native


def test_all_is_every_variant_this_cpu_runs_and_names_are_checked():
    if not native.host_isas():
        with pytest.raises(ValueError, match="--native-isa all"):
            isa.variants("all")
        return
    assert isa.variants("all") == list(native.host_isas())
    first = native.host_isas()[0]
    assert isa.variants(f"{first},{first}") == [first]
    with pytest.raises(ValueError, match="unknown native ISA 'sse9'"):
        isa.variants("sse9")
    other = next(v for v in native.ISAS if v not in native.host_isas())
    with pytest.raises(ValueError, match=f"--native-isa {other}: this CPU does not run it"):
        isa.variants(other)


def test_a_child_runs_the_same_command_with_its_own_json():
    argv = ["engine", "--native-isa", "all", "--concurrency", "8", "--json=/x/e.json", "--workloads", "1k/1k"]
    assert isa.child_argv(argv, "/x/e.v3.json") == ["engine", "--concurrency", "8", "--workloads", "1k/1k", "--json",
                                                    "/x/e.v3.json"]
    assert build_parser().parse_args(["engine", "--native-isa", "avx2"]).native_isa == "avx2"


def test_the_variants_side_by_side(tmp_path, monkeypatch, capsys):
    """Each child gets QWEN35_NATIVE_ISA and a JSON path of its own; the table holds each one's figures and the
    ratio to the first variant's."""
    seen = []

    def fake_run(cmd, env):
        variant = env["QWEN35_NATIVE_ISA"]
        seen.append((variant, cmd))
        path = cmd[cmd.index("--json") + 1]
        geo = {"x86-64-v4": 2.0, "x86-64-v3": 1.6}[variant]
        doc = {"environment": {"native_isa": variant}, "geomean_speedup": geo, "matmul_gflop_s": 140.0,
               "load": {"loadavg_1m_before": 0.1, "loadavg_1m_after": 0.2},
               "shapes": [{"batch": 1, "seq": 512, "timings": {"ours": {"median_s": 0.1 * 2 / geo}},
                           "matmul_roofline": {"ours": 0.3 * geo, "transformers": 0.4}, "speedup": geo}]}
        with open(path, "w") as f:
            json.dump(doc, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(isa.subprocess, "run", fake_run)
    doc = isa.run_variants("vs-transformers", ["vs-transformers", "--native-isa", "all"], str(tmp_path / "vs.json"),
                           ["x86-64-v4", "x86-64-v3"])
    assert [v for v, _ in seen] == ["x86-64-v4", "x86-64-v3"]
    assert seen[1][1][-2:] == ["--json", str(tmp_path / "vs.x86-64-v3.json")]
    assert doc["summary"]["x86-64-v3"]["geomean ours / HF"] == 1.6
    out = capsys.readouterr().out
    assert "side by side" in out and "geomean ours / HF" in out and "0.80x" in out

