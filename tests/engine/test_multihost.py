"""Beyond one host: 2 processes x 4 CPU devices joined by `jax.distributed` (gloo on loopback) give the same greedy
tokens as this process's 8 devices, for `dp8_ep8` + `replicate` (all-gathers and reduce-scatters between the
processes' devices every MoE layer).

Cost (~30 s of CPU per process): each process compiles two engine steps per case (prefill, then decode), so one
case only (`python -m qwen35_lib.engine.multihost --case ...` runs more); the two children run while this
process computes the reference.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest

from qwen35_lib.engine.multihost import DEFAULT_PROMPTS, child_env, generate_cases, parse_case

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = ["dp8_ep8:replicate"]
TIMEOUT_S = 240


def gloo_available() -> bool:
    try:
        from jax._src.lib import _jax
    except ImportError:
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(port: int) -> list[subprocess.Popen]:
    env = {**child_env(), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # two processes at once must not write one cache entry together
    cases = [a for c in CASES for a in ("--case", c)]
    return [subprocess.Popen([sys.executable, "-m", "qwen35_lib.engine.multihost", "--process-id", str(i),
                              "--num-processes", "2", "--coordinator", f"127.0.0.1:{port}", *cases], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives: multi-process CPU runs "
                                                 "cannot exchange data")
def test_two_processes_match_one_process():
    assert len(jax.devices()) == 8 and jax.process_count() == 1
    procs = launch(free_port())
    try:
        reference = generate_cases([parse_case(c) for c in CASES], DEFAULT_PROMPTS)  # meanwhile, 8 devices here
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
    docs = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outs]
    for i, doc in enumerate(docs):
        assert (doc["process_id"], doc["process_count"], doc["devices"], doc["local_devices"]) == (i, 2, 8, 4)
        assert doc["cases"] == reference, (i, doc["cases"], reference)  # every process: the same tokens
    assert all(len(ids) == 4 for case in reference for ids in case["output_ids"])


def test_child_env_drops_forced_device_count():
    env = child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_foo=1", "A": "b"})
    assert env == {"XLA_FLAGS": "--xla_cpu_foo=1", "A": "b"}
    assert "XLA_FLAGS" not in child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert os.environ.get("XLA_FLAGS")  # the parent's own flags are untouched


def test_parse_case():
    assert parse_case("dp8_ep8:replicate:fuse_allgather,hierarchical_rs") == dict(
        layout="dp8_ep8", routing="replicate", fuse_allgather=True, hierarchical_rs=True)
    assert parse_case("tp8_kvrep") == dict(layout="tp8_kvrep", routing="replicate", fuse_allgather=False,
                                           hierarchical_rs=False)
    with pytest.raises(ValueError, match="LAYOUT"):
        parse_case("dp8_ep8:replicate:fuse")
