"""`serve`'s command line: its options and defaults, the checks made before any weight is loaded, the socket bound
(or refused in one line) before uvicorn starts, the step shapes warmed up, and `run` wiring the engine, loop and
app together for a random preset (uvicorn's server stubbed: the HTTP side is tests/serve/test_app.py's)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import types

import pytest

from qwen35_lib import cli_generate
from qwen35_lib.serve import cli


def _parse(argv):
    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_options_and_defaults():
    a = _parse([])
    assert (a.host, a.port, a.warmup, a.layout, a.max_num_seqs, a.max_model_len) == ("127.0.0.1", 8000,
                                                                                     "background", "single", 8, 1024)
    assert a.max_prompt_chars is None and a.max_request_bytes == 16 << 20 and a.run is cli.run
    assert not a.ignore_unknown_fields and not a.trust_request_chat_template
    assert (a.max_stop_strings, a.max_bad_words, a.max_logit_bias, a.max_logprobs) == (256, 256, 1024, 20)
    assert a.shutdown_timeout == 10 and a.generation_config == "auto"
    for bad in (["--port", "70000"], ["--log-stats-interval", "-5"], ["--shutdown-timeout", "nan"],
                ["--max-logprobs", "-1"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_warmup_modes_split_the_shapes():
    """background: the shapes of one short request first (before /health is ok), every other after; all: every
    shape of both variants first; plain: those without logits processing; none: nothing."""
    engine = types.SimpleNamespace(decode_buckets=[1, 4], prefill_buckets=[0, 64], step_shape=lambda d, p: (d, d + p),
                                   workload_buckets=lambda lengths, out: [(1, 65), (1, 1)])
    first, later = cli.warmup_shapes(engine, "background")
    assert first == [(1, 65, False), (1, 1, False)]
    assert sorted(first + later) == sorted(cli.warmup_shapes(engine, "all")[0]) and len(later) == 6
    assert later[:2] == [(4, 4, False), (4, 68, False)]  # plain shapes before processed ones
    assert cli.warmup_shapes(engine, "plain") == ([(1, 1, False), (1, 65, False), (4, 4, False), (4, 68, False)], [])
    assert cli.warmup_shapes(engine, "none") == ([], [])


def test_longest_token_and_every_step_shape():
    vocab = {"a": 0, "hello": 1, "<|im_end|>": 2}
    text = types.SimpleNamespace(tokenizer=types.SimpleNamespace(get_vocab=lambda with_added_tokens: vocab))
    assert cli.longest_token_chars(text) == len("<|im_end|>")
    engine = types.SimpleNamespace(decode_buckets=[1, 4], prefill_buckets=[0, 64], step_shape=lambda d, p: (d, d + p))
    assert cli.all_buckets(engine) == [(1, 1), (1, 65), (4, 4), (4, 68)]


def test_the_socket_is_bound_or_refused_in_one_line():
    sock = cli.bind_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0
        sock.listen()
        with pytest.raises(ValueError, match=rf"cannot listen on 127.0.0.1:{port} \(.*\); pick another --port"):
            cli.bind_socket("127.0.0.1", port)  # in use
    finally:
        sock.close()
    with pytest.raises(ValueError, match=r"cannot listen on 127.0.0.1:99999"):
        cli.bind_socket("127.0.0.1", 99999)


@pytest.mark.parametrize("argv, error, message", [
    (["--checkpoint", "x", "--model", "qwen3.5-tiny"], ValueError, "--checkpoint and --model are exclusive"),
    (["--tokenizer", "/nonexistent"], FileNotFoundError, "--tokenizer /nonexistent has no tokenizer.json"),
    (["--fp8", "keep"], ValueError, "--fp8 keep keeps an FP8 checkpoint's experts in FP8: give an FP8 --checkpoint"),
    (["--layout", "tp8"], ValueError, "2 KV heads cannot be split over 8 devices"),
    (["--host", "256.1.1.1"], ValueError, r"cannot listen on 256\.1\.1\.1:8000 \(.*\); pick another --port"),
    (["--enable-auto-tool-choice"], ValueError, "--enable-auto-tool-choice and --tool-call-parser go together"),
])
def test_bad_input_fails_before_any_weight_is_loaded(monkeypatch, argv, error, message):
    monkeypatch.setattr(cli_generate, "load", lambda *a, **k: pytest.fail("weights loaded before the checks"))
    with pytest.raises(error, match=message):
        cli.run(_parse(argv))


def test_run_serves_a_random_preset(monkeypatch, capsys):
    served = {}

    class FakeServer:
        def __init__(self, config):
            served["app"], served["log_level"] = config.app, config.log_level

        def run(self, sockets):
            (sock,) = sockets
            served["port"] = sock.getsockname()[1]
            served["routes"] = {r.path for r in served["app"].routes}

    import uvicorn

    monkeypatch.setattr(uvicorn, "Server", FakeServer)
    assert cli.run(_parse(["--port", "0", "--warmup", "none", "--max-model-len", "64", "--served-model-name",
                           "tiny", "--compile-cache", "off"])) == 0
    err = capsys.readouterr().err
    assert "# random weights for qwen3.5-tiny" in err
    assert f"# serving tiny on http://127.0.0.1:{served['port']} (layout single, 1 rank(s) of max_num_seqs=8; no " \
           "tokenizer: token-id prompts only; 0 step shapes to compile" in err
    assert {"/v1/completions", "/v1/chat/completions", "/health", "/v1/models"} <= served["routes"]
    assert served["log_level"] == "warning"
    with pytest.raises(OSError):  # the socket is closed once the server returns
        socket.socket().connect(("127.0.0.1", served["port"]))


def test_compile_cache_folder(monkeypatch, tmp_path):
    """--compile-cache: a folder, 'off', or by default $JAX_COMPILATION_CACHE_DIR, else the user's cache folder."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli.compile_cache_dir(None) == tmp_path / "qwen35_lib" / "jax"
    assert cli.compile_cache_dir("off") is None and cli.compile_cache_dir(str(tmp_path / "c")) == tmp_path / "c"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "j"))
    assert cli.compile_cache_dir(None) == tmp_path / "j"
    args = _parse(["--max-model-len", "64"])
    child = cli._child_args(args)  # what the cache-filling child rebuilds its engine from: plain JSON values
    assert child["max_model_len"] == 64 and "run" not in child
    assert cli.spawn_cache_filler(args) is None  # nothing missed the cache: no child


CACHE_PROBE = """
import sys
import jax, jax.numpy as jnp
from qwen35_lib.serve import cli
cli.use_compile_cache(__import__("pathlib").Path(sys.argv[1]), write=sys.argv[2] == "write")
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(5.0)).block_until_ready()
print(cli.cache_misses(), cli.CACHE_EVENTS["/jax/compilation_cache/cache_hits"])
"""


def test_a_reading_server_counts_its_misses_and_the_filler_makes_them_hits(tmp_path):
    """The server reads the persistent cache only; what it missed is counted (so the filling child starts), the
    child writes it, and the next start finds it (jax's own miss event fires only on a write)."""
    def probe(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", CACHE_PROBE, str(tmp_path), mode], capture_output=True,
                             text=True, timeout=300, env=os.environ | {"JAX_PLATFORMS": "cpu"})
        assert out.returncode == 0, out.stderr[-2000:]
        return tuple(map(int, out.stdout.split()))

    missed, hits = probe("read")
    assert missed >= 1 and hits == 0 and not any(tmp_path.iterdir())  # missed, and nothing written by the reader
    probe("write")
    assert probe("read") == (0, missed)


@pytest.mark.parametrize("code, said", [("pass", "the compile cache is filled"),
                                        ("raise SystemExit(3)", "exited with 3")])
def test_the_filler_is_waited_for_and_its_end_reported(code, said, capsys):
    child = subprocess.Popen([sys.executable, "-c", code])
    cli.watch_filler(child)
    assert child.returncode is not None and said in capsys.readouterr().err


def _complete(monkeypatch, argv, body):
    """`run` with `argv` (the random preset, a stubbed uvicorn) answering one /v1/completions `body`."""
    from fastapi.testclient import TestClient

    answers = []

    class FakeServer:
        def __init__(self, config):
            self.app = config.app

        def run(self, sockets):
            with TestClient(self.app) as client:
                answers.append(client.post("/v1/completions", json=body, timeout=120))

    import uvicorn

    import qwen35_lib.engine

    engines = []

    class Recorded(qwen35_lib.engine.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(uvicorn, "Server", FakeServer)
    monkeypatch.setattr(qwen35_lib.engine, "Engine", Recorded)
    assert cli.run(_parse(["--port", "0", "--warmup", "none", "--max-model-len", "64", "--max-num-seqs", "2",
                           "--compile-cache", "off", *argv])) == 0
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    return answer.json(), engines[0]


def test_speculative_tokens_serve_the_same_greedy_completion(monkeypatch, tmp_path):
    """--speculative-tokens 2 (the random preset's random MTP head: drafts verified and rolled back every step) serves
    the greedy completion served without it; a checkpoint without a head is refused in one line before serving."""
    body = dict(model="qwen3.5-tiny", prompt=[3, 14, 15, 92, 65], max_tokens=10, temperature=0, ignore_eos=True,
                return_token_ids=True)
    want, plain = _complete(monkeypatch, [], body)
    got, spec = _complete(monkeypatch, ["--speculative-tokens", "2"], body)
    assert got["choices"][0] == want["choices"][0] and len(want["choices"][0]["token_ids"]) == 10
    assert spec.stats.drafted > 0 and plain.stats.drafted == 0
    assert _parse(["--speculative-tokens", "3"]).speculative_tokens == 3
    with pytest.raises(SystemExit):
        _parse(["--speculative-tokens", "-1"])
    pytest.importorskip("transformers")
    from qwen35_lib import testing

    headless = testing.save_hf_checkpoint(testing.make_hf_model(), tmp_path / "ckpt", "fused")
    with pytest.raises(ValueError, match=r"--speculative-tokens 2 drafts with the checkpoint's MTP head, and .* has "
                                         r"none \(no mtp\.\* tensors\)") as e:
        cli.run(_parse(["--port", "0", "--checkpoint", str(headless), "--speculative-tokens", "2",
                        "--max-model-len", "64", "--compile-cache", "off"]))
    assert "\n" not in str(e.value)


def test_speculative_warmup_compiles_the_processing_variant_too():
    """With drafts a processed request (penalties, bias, bad words, min_tokens) runs the processed step, each verified
    position processed with the drafts before it: the warm-up compiles it beside the plain one, each `step_shape`
    (decode rows of k + 1 tokens)."""
    engine = types.SimpleNamespace(decode_buckets=[1, 4], prefill_buckets=[0, 64], width=3,
                                   step_shape=lambda d, p: (d, 3 * d + p),
                                   workload_buckets=lambda lengths, out: [(1, 67), (1, 3)])
    first, later = cli.warmup_shapes(engine, "background")
    assert first + later == [(1, 67, False), (1, 3, False), (4, 12, False), (4, 76, False),
                             (1, 3, True), (1, 67, True), (4, 12, True), (4, 76, True)]
