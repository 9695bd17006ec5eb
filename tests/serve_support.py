"""A server for the serve tests: the tiny random model (float32) behind `make_app` on an ephemeral 127.0.0.1 port,
in a thread of the test process, with a byte-level tokenizer and a ChatML template (`test_text`).

References are the same prompts run alone through a fresh `Engine` with the same weights. To keep compilation to
few step shapes (the jitted step is shared process-wide, so every serve test module reuses them), engines pad
every step's decodes to max_num_seqs (`decode_buckets`): test-only, it changes which shapes compile, not what a
request computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import socket
import threading
import time

import httpx
import numpy as np
import openai

from qwen35_lib.config import get_config
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
from qwen35_lib.text import load_text
from qwen35_lib.weights import init_weights
from tests.test_text import make_tokenizer_dir

EC = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=128)
MODEL = "tiny-test"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@dataclasses.dataclass
class Server:
    url: str
    loop: object
    engine: Engine
    text: object
    config: object
    weights: dict
    tok_dir: pathlib.Path | None = None  # the tokenizer's directory (tokenizer.json, tokenizer_config.json)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def alone(self, prompt: list[int], max_tokens: int, **params) -> list[int]:
        """The prompt run by itself through a fresh engine (greedy, EOS ignored unless `params` say)."""
        e = Engine(self.config, self.weights, EC)
        e.decode_buckets = (EC.max_num_seqs,)
        params = dict(ignore_eos=True) | params
        return e.generate([prompt], SamplingParams(max_new_tokens=max_tokens, **params))[0].output_ids

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()


@contextlib.contextmanager
def running(tok_dir: pathlib.Path, limits=None, warmup=(), background=False, on_compiled=None, step_fn=None):
    import uvicorn

    from qwen35_lib.serve.app import make_app
    from qwen35_lib.serve.loop import EngineLoop

    config = get_config("qwen3.5-tiny", dtype="float32")
    weights = init_weights(config, 0)
    engine = Engine(config, weights, EC)
    engine.decode_buckets = (EC.max_num_seqs,)
    if step_fn is not None:  # a stand-in step (scripted outputs: `scripted_step`)
        engine.step_fn = step_fn
    tok_dir = make_tokenizer_dir(tok_dir)
    text = load_text(tok_dir)
    if warmup == "all":  # every step shape, with and without logits processing (`serve --warmup all`)
        from qwen35_lib.serve.cli import all_buckets

        warmup = [(d, t, p) for p in (False, True) for d, t in all_buckets(engine)]
    later = []
    if background:  # `serve --warmup background`: every step shape (both variants) compiled behind the server
        from qwen35_lib.serve.cli import all_buckets

        later = [(d, t, p) for p in (False, True) for d, t in all_buckets(engine)]
    loop = EngineLoop(engine, warmup=warmup, background=later, on_compiled=on_compiled).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(make_app(loop, MODEL, text, limits), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", loop, engine, text, config, weights, tok_dir)
    finally:
        uv.should_exit = True
        thread.join(30)
        loop.stop()
        sock.close()


@contextlib.contextmanager
def health_probes(url: str, interval: float):
    """GET `url`/health every `interval` s on a thread while the block runs: the (perf_counter when answered, status)
    of each probe (the list grows as it runs; status 0: no answer within 30 s, the client's guard against a hang).
    The tests check what /health answered and when, beside other events; how long it took is
    `python -m qwen35_lib.bench serve-stress`'s to measure, never a test's to bound."""
    out: list[tuple[float, int]] = []
    done = threading.Event()

    def poll():
        with httpx.Client(timeout=30) as c:
            while True:  # at least one probe, however short the block
                try:
                    status = c.get(url + "/health").status_code
                except httpx.HTTPError:
                    status = 0
                out.append((time.perf_counter(), status))
                if done.wait(interval):
                    return

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()


def answered_between(probes: list[tuple[float, int]], t0: float, t1: float) -> int:
    """How many of `health_probes`' answers came back after `t0` and before `t1`."""
    return sum(t0 < t < t1 for t, _ in probes)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, size=int(rng.integers(3, 20)))] for _ in range(n)]


def wait_idle(server: Server, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while True:
        h = server.health()
        if h["running"] == 0 and h["waiting"] == 0 or time.time() > deadline:
            return h
        time.sleep(0.05)


def scripted_step(script: dict[int, int]):
    """A stand-in for the engine's jitted step that samples `script[position]` at each position (0 elsewhere) and
    leaves the cache alone: outputs chosen by the test, through the real scheduler, loop and server."""
    import jax.numpy as jnp

    def step(cfg, plan, weights, cache, tokens, meta, samp):
        pos = np.asarray(samp["position"])  # [R, S]: the position of the token each row samples
        out = np.vectorize(lambda p: script.get(int(p), 0), otypes=[np.int32])(pos)
        return jnp.asarray(out), cache

    return step
