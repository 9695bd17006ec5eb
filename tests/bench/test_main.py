"""Smoke tests of the benchmark scripts: each runs end to end at a tiny size and writes valid JSON.

No timing assertions (benchmarks measure, they do not judge); only structure, and that the compared outputs agree.
"""

import json

import pytest

from qwen35_lib.bench.__main__ import HUGE_PAGES, huge_pages_env, main


def test_unknown_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-benchmark"])
    assert e.value.code == 2
    assert "vs-transformers" in capsys.readouterr().err  # argparse lists the choices


def test_huge_pages_env_only_where_it_applies():
    madvise = "always [madvise] never\n"
    env = huge_pages_env({"PATH": "/bin"}, ("glibc", "2.36"), madvise)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": HUGE_PAGES}
    kept = huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, ("glibc", "2.36"), madvise)
    assert kept["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGES}"
    for environ, libc, thp in [({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, ("glibc", "2.36"), madvise),  # set
                               ({"QWEN35_HUGEPAGES": "0"}, ("glibc", "2.36"), madvise),  # turned off
                               ({}, ("glibc", "2.31"), madvise), ({}, ("", ""), madvise),  # old glibc, musl
                               ({}, ("glibc", "2.36"), "[always] madvise never"), ({}, ("glibc", "2.36"), None)]:
        assert huge_pages_env(environ, libc, thp) is None, (environ, libc, thp)


def test_bench_profile_writes_a_trace(tmp_path):
    """The cheapest benchmark (kernels: one MoE case of the tiny model, no other section) under --profile."""
    out, prof = tmp_path / "kernels.json", tmp_path / "prof"
    assert main(["kernels", "--model", "qwen3.5-tiny", "--tokens", "8", "--dtypes", "float32", "--repeats", "1",
                 "--settle", "0", "--no-dense", "--no-interpret-check", "--no-attention", "--no-gdn",
                 "--json", str(out), "--profile", str(prof)]) == 0
    assert json.loads(out.read_text())["cases"]
    traces = list(prof.glob("plugins/profile/*/*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
