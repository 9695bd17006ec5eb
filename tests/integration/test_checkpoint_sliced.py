"""The sliced loader (`load_hf_checkpoint(..., mesh=)`): its peak host memory, and its equality with the whole-leaf
path (`place=sharded_place(...)`, which builds each whole leaf on the host, then cuts it into shards).

Memory is measured in a subprocess as `RssAnon` (anonymous resident pages: the memory-mapped safetensors pages are
file pages, RssFile, and do not count). The protocol, per loader:
1. import jax, make the 8-device mesh, load once and drop the weights (every XLA program the load needs is compiled
   then: their code is a fixed cost per program, the same for a 397B checkpoint, not a cost of its bytes);
   `malloc_trim(0)` returns the freed heap to the OS, so the measured load cannot hide in pages freed by the first;
2. baseline = RssAnon; load again, sampling RssAnon in a thread every 0.5 ms and on every tensor read
   (`safetensors_io.READ_HOOKS`); the peak minus the baseline is the load's host cost;
3. final = the bytes of every device shard of every leaf (on CPU the devices' memory is the host's; replicated
   leaves count once per device).
Bound: peak - baseline <= final + chunk + SLACK, where chunk is the largest piece one op writes into one device's
shard (one expert's [D, 2, F], 0.5 MiB here) and SLACK (32 MiB) covers the bookkeeping that does not grow with the
weights (the plan's ops, jax.Array and memmap objects, XLA's per-call buffers, malloc arenas): measured at ~14 MiB.
The whole-leaf path holds the stacked w_gate_up leaf (128 MiB) on the host while its shards are made: it exceeds
the bound by far (~110 MiB over final measured), so the test can fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import testing  # noqa: E402
from qwen35_lib.checkpoint import load_hf_checkpoint, path_infos, sharded_place  # noqa: E402
from qwen35_lib.plan import make_mesh  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning")]
MiB = 2 ** 20
SLACK = 32 * MiB
# Experts dominate: 4 layers x 64 experts x (gate, up, down) of 256 x 256 float32 = 192 MiB of 195 MiB on disk;
# the stacked w_gate_up leaf [1, 4, 64, 256, 2, 256] is 128 MiB, one expert's piece of it 0.5 MiB.
BIG = dict(hidden_size=256, num_experts=64, moe_intermediate_size=256, num_experts_per_tok=4)
CHUNK = 256 * 2 * 256 * 4

MEASURE = r"""
import ctypes, gc, json, os, sys, threading, time
path, layout, how = sys.argv[1:4]

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

import jax
from qwen35_lib import safetensors_io
from qwen35_lib.checkpoint import path_infos, load_hf_checkpoint, sharded_place
from qwen35_lib.config import from_hf_config, read_json
from qwen35_lib.plan import get_layout, make_mesh

mesh = make_mesh()

def load():
    if how == "sliced":
        return load_hf_checkpoint(path, mesh=mesh, layout=layout, progress=False)[1]
    config = from_hf_config(read_json(os.path.join(path, "config.json"), "config.json"), name=os.path.basename(path))
    return load_hf_checkpoint(path, place=sharded_place(config, get_layout(layout), mesh), progress=False)[1]

jax.block_until_ready(load())
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
peak, stop = [0], threading.Event()

def sample():
    peak[0] = max(peak[0], rss_anon())

def sampler():
    while not stop.is_set():
        sample()
        time.sleep(0.0005)

safetensors_io.READ_HOOKS.append(lambda *_: sample())
base = rss_anon()
thread = threading.Thread(target=sampler, daemon=True)
thread.start()
weights = jax.block_until_ready(load())
stop.set()
thread.join()
sample()
final = sum(s.data.nbytes for _, leaf in path_infos(weights) for s in leaf.addressable_shards)
print(json.dumps({"base": base, "peak": peak[0], "final": final}))
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    model = testing.make_hf_model("qwen3_5_moe", **BIG)
    return testing.save_hf_checkpoint(model, tmp_path_factory.mktemp("big") / "experts", "per_expert")


def measure(path, layout: str, how: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = subprocess.run([sys.executable, "-c", MEASURE, str(path), layout, how], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RssAnon is read from Linux's /proc")
def test_sliced_load_peak_host_memory(big):
    """dp8_ep8 (experts split 8 ways): the sliced load stays within final + chunk + SLACK; the whole-leaf one not."""
    sliced, whole = measure(big, "dp8_ep8", "sliced"), measure(big, "dp8_ep8", "whole")
    assert sliced["final"] == whole["final"] > 200 * MiB  # the same shards either way
    bound = sliced["final"] + CHUNK + SLACK

    def report(m):
        return f"peak - base {(m['peak'] - m['base']) / MiB:.1f} MiB, final {m['final'] / MiB:.1f} MiB"

    assert sliced["peak"] - sliced["base"] <= bound, report(sliced)
    assert whole["peak"] - whole["base"] > bound, report(whole)


def assert_same_leaves(a, b) -> None:
    la, lb = path_infos(a), path_infos(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb, strict=True):
        assert (x.shape, x.dtype, x.sharding) == (y.shape, y.dtype, y.sharding), p
        for sx, sy in zip(x.addressable_shards, y.addressable_shards, strict=True):
            assert sx.device == sy.device and sx.index == sy.index, p
            np.testing.assert_array_equal(np.asarray(sx.data), np.asarray(sy.data), err_msg="/".join(p))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    models = {mt: testing.make_hf_model(mt) for mt in ("qwen3_5_moe", "qwen3_next")}
    return lambda mt, form: testing.save_hf_checkpoint(models[mt], root / f"{mt}_{form}", form) \
        if not (root / f"{mt}_{form}").exists() else root / f"{mt}_{form}"


@pytest.mark.parametrize("model_type, form, fp8, layout", [
    ("qwen3_5_moe", "per_expert", "dequantize", "dp8_ep8"),  # experts split: one device reads each expert
    ("qwen3_5_moe", "fused", "dequantize", "dp8_ep8"),  # [E, 2F, D] tensors: each device reads its experts' rows
    ("qwen3_next", "fp8", "keep", "dp8_ep8"),  # BlockFP8 values and scales, as stored
    ("qwen3_next", "fp8", "dequantize", "tp8_kvrep"),  # TP: every device a column slice of every tensor
    ("qwen3_5_moe", "fused", "dequantize", "tp8_kvrep")])
def test_sliced_equals_whole_leaf_load(small, model_type, form, fp8, layout):
    """Leaf by leaf and shard by shard, the sliced load equals the whole-leaf load (the loader of before)."""
    from qwen35_lib.plan import get_layout

    path = small(model_type, form)
    mesh = make_mesh()
    config, sliced = load_hf_checkpoint(path, mesh=mesh, layout=layout, fp8=fp8, progress=False)
    again, whole = load_hf_checkpoint(path, place=sharded_place(config, get_layout(layout), mesh), fp8=fp8,
                                      progress=False)
    assert config == again
    assert_same_leaves(sliced, whole)


def test_progress_bar(small, capsys):
    """progress=True: a tqdm bar on stderr counting the reads and their bytes to the end."""
    path = small("qwen3_5_moe", "fused")
    load_hf_checkpoint(path, mesh=make_mesh(), layout="dp8_ep8", progress=True)
    err = capsys.readouterr().err
    assert "loading qwen3_5_moe_fused" in err
    done, total = re.findall(r"(\d+)/(\d+) reads", err)[-1]
    assert done == total and int(total) > 0
    assert "100%" in err
