"""Every command line of the package ends bad input with one `error: ...` line and exit status 2, no traceback;
`--debug` (before or after the subcommand) shows it instead.

1. A table of bad inputs per CLI, run in-process through its `main(argv)` (what `python -m` runs; loading a
   malformed checkpoint compiles nothing, so each case takes milliseconds);
2. `--debug` re-raises, wherever it is placed;
3. one subprocess per CLI, the real entry point: status 2 and one line, and with `--debug` a traceback.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from qwen35_lib import cli_errors
from qwen35_lib.__main__ import main as qwen35_main
from qwen35_lib.bench.__main__ import main as bench_main
from qwen35_lib.costmodel.__main__ import main as costmodel_main

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAINS = {"qwen35_lib": qwen35_main, "qwen35_lib.costmodel": costmodel_main, "qwen35_lib.bench": bench_main}
# config.json of a checkpoint of the qwen3.5-tiny shapes (the flat Qwen3-Next form), no weights needed
TINY_CONFIG = dict(
    model_type="qwen3_next", vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, max_position_embeddings=4096, rms_norm_eps=1e-6, eos_token_id=1,
    tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def safetensors_bytes(header) -> bytes:
    """A safetensors file of `header` (any JSON) and no data."""
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h


# name -> {file: text or bytes}; config.json defaults to TINY_CONFIG
CHECKPOINTS = {
    "bad_json": {"config.json": '{"model_type": '},
    "config_list": {"config.json": "[1, 2]"},
    "field_type": {"config.json": json.dumps({**TINY_CONFIG, "num_hidden_layers": "four"})},
    "no_weight_map": {"model.safetensors.index.json": '{"metadata": {}}'},
    "header_entry_int": {"model.safetensors": safetensors_bytes({"a": 5})},
    "header_list": {"model.safetensors": safetensors_bytes([1, 2])},
    "no_weights": {},
    "short_file": {"model.safetensors": b"\x01\x02"},
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad_ckpt")
    out = {}
    for name, files in CHECKPOINTS.items():
        d = root / name
        d.mkdir()
        files = {"config.json": json.dumps(TINY_CONFIG), **files}
        for fname, content in files.items():
            (d / fname).write_bytes(content if isinstance(content, bytes) else content.encode())
        out[name] = str(d)
    out["missing"] = str(root / "does_not_exist")
    out["a_dir"] = str(root)
    return out


GEN = ["generate", "--prompt-ids", "1 2"]
# (cli, argv with {checkpoint names} to fill in, a piece of the error line)
CASES = [
    # python -m qwen35_lib generate
    ("qwen35_lib", [*GEN, "--checkpoint", "{bad_json}"], "JSON"),
    ("qwen35_lib", [*GEN, "--checkpoint", "{config_list}"], "list"),
    ("qwen35_lib", [*GEN, "--checkpoint", "{field_type}"], "four"),
    ("qwen35_lib", [*GEN, "--checkpoint", "{missing}"], "does not exist"),
    ("qwen35_lib", [*GEN, "--checkpoint", "{no_weight_map}"], "weight_map"),
    ("qwen35_lib", [*GEN, "--checkpoint", "{header_entry_int}"], "safetensors"),
    ("qwen35_lib", [*GEN, "--checkpoint", "{header_list}"], "safetensors"),
    ("qwen35_lib", [*GEN, "--checkpoint", "{short_file}"], "safetensors"),
    ("qwen35_lib", [*GEN, "--checkpoint", "{no_weights}"], "no *.safetensors"),
    ("qwen35_lib", ["generate", "--prompt-ids", "1 x"], "'x' is not an integer token id"),
    ("qwen35_lib", ["generate", "--prompt-ids", "1", "--max-new-tokens", "x"], "invalid int value"),
    ("qwen35_lib", [*GEN, "--layout", "nope"], "invalid choice: 'nope'"),
    ("qwen35_lib", [*GEN, "--model", "nope"], "unknown model 'nope'"),
    ("qwen35_lib", [*GEN, "--page-size", "0"], "page_size"),
    ("qwen35_lib", [], "required"),
    ("qwen35_lib", ["nope"], "invalid choice"),
    # python -m qwen35_lib info
    ("qwen35_lib", ["info", "--model", "nope"], "unknown model 'nope'"),
    ("qwen35_lib", ["info", "--model", "{config_list}"], "list"),
    ("qwen35_lib", ["info", "--model", "{bad_json}"], "JSON"),
    ("qwen35_lib", ["info", "--model", "qwen3.5-tiny", "--hardware", "nope"], "unknown hardware 'nope'"),
    ("qwen35_lib", ["info", "--model", "qwen3.5-tiny", "--concurrency", "4"], "need --hardware"),
    ("qwen35_lib", ["info", "--model", "qwen3.5-tiny", "--hardware", "cpu", "--concurrency", "-1"], "must be >= 0"),
    # python -m qwen35_lib.costmodel
    ("qwen35_lib.costmodel", ["predict", "--max-batched-tokens", "-5"], "max_batched_tokens=-5"),
    ("qwen35_lib.costmodel", ["predict", "--max-batched-tokens", "0"], "max_batched_tokens=0"),
    ("qwen35_lib.costmodel", ["predict", "--max-seqs", "0"], "max_seqs=0"),
    ("qwen35_lib.costmodel", ["predict", "--concurrency", "0"], "concurrency=0"),
    ("qwen35_lib.costmodel", ["predict", "--concurrency", "-5"], "concurrency=-5"),
    ("qwen35_lib.costmodel", ["predict", "--isl", "0"], "isl=0"),
    ("qwen35_lib.costmodel", ["predict", "--osl", "-1"], "osl=-1"),
    ("qwen35_lib.costmodel", ["predict", "--kv-dtype", "foo"], "invalid choice: 'foo'"),
    ("qwen35_lib.costmodel", ["predict", "--model", "nope"], "unknown model 'nope'"),
    ("qwen35_lib.costmodel", ["predict", "--hardware", "nope"], "unknown hardware 'nope'"),
    ("qwen35_lib.costmodel", ["predict", "--layout", "tp8"], "KV heads cannot be split"),
    ("qwen35_lib.costmodel", ["predict", "--stage", "nope"], "invalid choice: 'nope'"),
    ("qwen35_lib.costmodel", ["ladder", "--concurrency", "0"], "concurrency=0"),
    ("qwen35_lib.costmodel", [], "required"),
    # python -m qwen35_lib.bench
    ("qwen35_lib.bench", ["kernels", "--repeats", "0"], "--repeats must be at least 1"),
    ("qwen35_lib.bench", ["kernels", "--json", "{a_dir}"], "is a directory"),
    ("qwen35_lib.bench", ["kernels", "--json", "/proc/version/x/out.json"], "cannot create its folder"),
    ("qwen35_lib.bench", ["nope"], "invalid choice: 'nope'"),
]


def run_main(cli: str, argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of `main(argv)`, argparse's exits included."""
    try:
        status = MAINS[cli](argv)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("cli, argv, piece", CASES, ids=[f"{c}:{' '.join(a)}" for c, a, _ in CASES])
def test_bad_input_ends_with_one_error_line(ckpt, capsys, cli, argv, piece):
    status, err = run_main(cli, [a.format(**ckpt) for a in argv], capsys)
    last = err.splitlines()[-1] if err else ""
    assert status == 2 and last.startswith("error: ") and piece in last, err
    assert "Traceback" not in err


@pytest.mark.parametrize("cli, argv, raised", [
    ("qwen35_lib", ["--debug", *GEN, "--checkpoint", "{config_list}"], ValueError),  # the loader's ConfigError
    ("qwen35_lib", [*GEN, "--checkpoint", "{no_weight_map}", "--debug"], ValueError),  # its CheckpointError
    ("qwen35_lib", ["info", "--model", "nope", "--debug"], ValueError),
    ("qwen35_lib.costmodel", ["--debug", "predict", "--isl", "0"], ValueError),
    ("qwen35_lib.costmodel", ["ladder", "--concurrency", "0", "--debug"], ValueError),
    ("qwen35_lib.bench", ["--debug", "kernels", "--repeats", "0"], ValueError),
    ("qwen35_lib.bench", ["kernels", "--json", "{a_dir}", "--debug"], ValueError),
])
def test_debug_raises_wherever_it_is(ckpt, cli, argv, raised):
    with pytest.raises(raised):
        MAINS[cli]([a.format(**ckpt) for a in argv])


def test_structure_errors_say_where():
    try:
        {}["weight_map"]
    except KeyError as e:
        line = cli_errors.describe(e)
    assert line.startswith("the input has an unexpected structure (missing entry 'weight_map', raised at ")
    assert "test_cli_errors.py:" in line and "--debug" in line
    assert cli_errors.describe(ValueError("two\n  lines")) == "two lines"
    assert cli_errors.describe(json.JSONDecodeError("Expecting value", "{", 1)).startswith("invalid JSON: ")


def test_guard_passes_other_errors_and_interrupts(capsys):
    with pytest.raises(ZeroDivisionError):  # a bug, or a check still missing: its traceback stays
        cli_errors.guard(lambda: 1 // 0)

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert cli_errors.guard(interrupted) == 130 and capsys.readouterr().err == "error: interrupted\n"
    assert cli_errors.guard(lambda: 0) == 0


@pytest.mark.parametrize("module, argv", [
    ("qwen35_lib", [*GEN, "--checkpoint", "{config_list}"]),
    ("qwen35_lib.costmodel", ["predict", "--max-batched-tokens", "-5"]),  # never returned before
    ("qwen35_lib.bench", ["kernels", "--repeats", "0"]),
])
def test_entry_points(ckpt, module, argv):
    """`python -m MODULE`: status 2 and one error line; with --debug, the traceback (status 1)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [a.format(**ckpt) for a in argv]
    for debug in (False, True):
        out = subprocess.run([sys.executable, "-m", module, *argv, *(["--debug"] if debug else [])], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120)
        if debug:
            assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr, out.stderr
        else:
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
            assert out.stderr.splitlines()[-1].startswith("error: ")
