"""`python -m qwen35_lib.bench serve-stress`: the serve tests' abusive loads against the tiny random model, with the
latencies those tests check only for liveness measured and reported here (never asserted).

1. Build the server the serve tests use, in this process (`serve_support.running`'s pieces): the `qwen3.5-tiny`
   preset with seeded random float32 weights, a byte-level tokenizer with a ChatML template written to a temporary
   folder (`testing.make_tokenizer_dir`), `EngineLoop` over `Engine` (8 sequences, 64 tokens a step, pages of 8,
   max_model_len 128, decodes padded to 8) and `make_app` (every other bound at its default) behind uvicorn on an
   ephemeral 127.0.0.1 port. Nothing is downloaded. With `--warmup all` (the default) every step shape is compiled
   before /health says ok, so no compile lands in a latency. The load's clients are threads of the same process:
   they share its GIL with the server, as in the tests.
2. For the whole run, GET /health every `--health-interval` s on a thread (each probe's start, end and status kept);
   after a second of the idle server (`idle`: the floor of a probe on this machine), stream `--stream-tokens`-token
   completions one after another (each token's arrival time kept).
3. Scenarios, each a window of that run:
   a. `beside_stream`: each group of `abusive_bodies` sent alone (a group's bodies at once): an 8 MB prompt,
      4,000 prompts, a 1M-character prompt tokenized in full, four 400k-word bad_words lists, 20k bad words,
      1M stop strings, 2k logit_bias entries, a 1.1M-character stop string, 100k-deep nesting, a 5k-deep nested
      prompt (tests/serve/test_loop.py, test_protocol.py, tests/integration/test_serve_fuzz.py); per group its
      statuses, seconds to answer, the /health probes overlapping it (p50 / max ms) and the largest gap between
      two tokens of the stream meanwhile;
   b. `all_at_once`: every group's bodies at once (tests/serve/test_loop.py's load);
   c. `random_bodies`: `--random-bodies` random bodies (every field the protocol knows, values of every JSON type,
      in and out of range), 4 clients at once (tests/integration/test_serve_fields_fuzz.py's).
4. Record the machine's load beside them (load average before and after, CPU count, this process's CPU seconds),
   print a table, return the JSON document; `exit_status` 1 (after the JSON is written) where an answer was a 5xx
   or a stream came back short: the functional checks, which the tests make too.
`--body-scale F` multiplies every abusive body's size by F (its test runs the whole benchmark at a tiny size).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import platform
import random
import resource
import tempfile
import threading
import time
from typing import Any

import numpy as np

DESCRIPTION = "the serve tests' abusive loads on the tiny model: /health latency and token gaps beside each (JSON)"
MODEL = "tiny-test"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--body-scale", type=_fraction, default=1.0, metavar="F",
                   help="the abusive bodies' sizes times F, in (0, 1] (default 1: the tests' sizes)")
    p.add_argument("--random-bodies", type=int, default=300, metavar="N", help="random bodies (default %(default)s)")
    p.add_argument("--stream-tokens", type=int, default=120, metavar="N",
                   help="tokens of each background stream (default %(default)s)")
    p.add_argument("--health-interval", type=float, default=0.02, metavar="S",
                   help="seconds between two /health probes (default %(default)s)")
    p.add_argument("--warmup", choices=("all", "none"), default="all",
                   help="all: compile every step shape before measuring (default); none: compile on first use")
    p.add_argument("--seed", type=int, default=52, help="weights and random bodies (default %(default)s)")


def _fraction(value: str) -> float:
    x = float(value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return x


# --- the loads ---------------------------------------------------------------------------------------------------
def abusive_bodies(scale: float = 1.0) -> dict[str, list[tuple[str, bytes]]]:
    """Groups of (path, body) sent together, by name; sizes times `scale` (at least 1)."""
    n = lambda x: max(1, int(x * scale))
    dumps = lambda doc: json.dumps(doc).encode()
    one = lambda **doc: [(COMPLETIONS, dumps({"model": MODEL, "max_tokens": 1} | doc))]
    depth = n(100_000)
    nested = n(5_000)
    return {
        "prompt_8MB_chars": one(prompt="x" * n(8 << 20)),
        "prompts_4000": one(prompt=[[7]] * n(4000)),
        "prompt_1M_chars_tokenized": one(prompt="x" * n(1_000_000)),
        "bad_words_400k_x4": [one(prompt=[1], bad_words=[f"word{i}" for i in range(k * 7, k * 7 + n(400_000))])[0]
                              for k in range(4)],
        "bad_words_20k": one(prompt=[1], bad_words=[f"w{i}" for i in range(n(20_000))]),
        "stop_1M_strings": one(prompt=[1], stop=["x"] * n(1_000_000)),
        "logit_bias_2k": one(prompt=[1], logit_bias={str(i): 1 for i in range(n(2000))}),
        "stop_string_1.1M_chars": one(prompt=[1], stop=["y" * n(1_100_000)]),
        "nested_100k_deep": [(COMPLETIONS, b"[" * depth + b"]" * depth)],
        "prompt_nested_5k_deep": [(COMPLETIONS, b'{"prompt": ' + b"[" * nested + b"1" + b"]" * nested + b"}")],
        "chat_lone_surrogates": [(CHAT, b'{"messages": [{"role": "user\\ud800", "content": "\\udfff"}], '
                                        b'"max_tokens": 1}')],
    }


VALUES = [None, True, False, 0, 1, 2, -1, 3.5, -0.5, 2**63, -2**70, 1e308, "", "x", "NaN", "\ud800", "a" * 5000,
          [], [1, 2], ["a"], [[1]], [None], [3, -1], {}, {"1": 1}, {"7": 100}, {"a": {"b": []}}, {"x": "y"}]
PROMPTS = [[1, 2, 3], "hi", [], [[1], [2, 3]], 5, None, [300], ["a", [4]], "\x00"]
MESSAGES = [[{"role": "user", "content": "hi"}], [], [{"role": 3}], "hi", [{"role": "user", "content": [1]}]]
SMALL = [None, 0, 1, 2, -1, 10**9, "5", 3.0]
COUNTS = ("n", "best_of", "logprobs", "top_logprobs", "max_tokens", "prompt_logprobs", "min_tokens")


def random_body(rng: random.Random) -> tuple[str, bytes]:
    """One random body, as tests/integration/test_serve_fields_fuzz.py draws them: 70% start valid (so that the
    fields are exercised past the parser), then up to 3 (else 6) fields of the protocol with values of every JSON
    type."""
    from qwen35_lib.serve import protocol

    chat = rng.random() < 0.4
    fields = sorted((protocol.CHAT if chat else protocol.COMPLETION) | protocol.NO_EFFECT | set(protocol.REFUSED))
    sane = rng.random() < 0.7
    doc: dict[str, Any] = {"model": MODEL, "max_tokens": rng.choice([1, 2, 4] if sane else SMALL)}
    doc["messages" if chat else "prompt"] = (MESSAGES if chat else PROMPTS)[0] if sane else \
        rng.choice(MESSAGES if chat else PROMPTS)
    for name in rng.sample(fields, rng.randint(0, 3 if sane else 6)):
        if name not in ("model", "prompt", "messages"):
            doc[name] = rng.choice(SMALL if name in COUNTS else VALUES)
    if rng.random() < 0.05:
        doc["no_such_field"] = 1
    return (CHAT if chat else COMPLETIONS), json.dumps(doc).encode()


# --- the server --------------------------------------------------------------------------------------------------
class _Server:
    """The serve tests' server (module docstring, step 1), started by `start`, stopped by `stop`."""

    def __init__(self, tok_dir: str, warmup: str, seed: int):
        import socket

        import uvicorn

        from qwen35_lib.config import get_config
        from qwen35_lib.engine import Engine, EngineConfig
        from qwen35_lib.serve import protocol
        from qwen35_lib.serve.app import make_app
        from qwen35_lib.serve.cli import all_buckets
        from qwen35_lib.serve.loop import EngineLoop
        from qwen35_lib.testing import make_tokenizer_dir
        from qwen35_lib.text import load_text
        from qwen35_lib.weights import init_weights

        ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=128)
        config = get_config("qwen3.5-tiny", dtype="float32")
        engine = Engine(config, init_weights(config, seed), ec)
        engine.decode_buckets = (ec.max_num_seqs,)  # few step shapes, as the serve tests compile them
        text = load_text(make_tokenizer_dir(pathlib.Path(tok_dir)))
        shapes = [(d, t, p) for p in (False, True) for d, t in all_buckets(engine)] if warmup == "all" else []
        self.loop = EngineLoop(engine, warmup=shapes).start()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        app = make_app(self.loop, MODEL, text, protocol.Limits(max_model_len=ec.max_model_len))
        self.uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs=dict(sockets=[self.sock]), daemon=True)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def start(self, timeout: float = 600.0) -> float:
        """Start uvicorn and wait for /health 200 (the warm-up compiled); the seconds that took."""
        import httpx

        t = time.perf_counter()
        self.thread.start()
        while True:
            if not self.thread.is_alive() or self.loop.error or time.perf_counter() - t > timeout:
                raise RuntimeError(f"the server did not come up in {timeout:.0f} s ({self.loop.error or 'no error'})")
            try:
                if self.uv.started and httpx.get(self.url + "/health", timeout=30).status_code == 200:
                    return time.perf_counter() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)
        self.loop.stop()
        self.sock.close()


class _Health:
    """GET /health every `interval` s on a thread: (start, end, status) of each probe (status 0: no answer)."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval, self.probes = url, interval, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import httpx

        with httpx.Client(timeout=60) as c:
            while not self.done.is_set():
                t = time.perf_counter()
                try:
                    status = c.get(self.url + "/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.probes.append((t, time.perf_counter(), status))
                time.sleep(self.interval)

    def window(self, t0: float, t1: float) -> dict:
        """The probes overlapping [t0, t1]: how many, their p50 / max latency in ms, how many not 200."""
        probes = [p for p in self.probes if p[0] < t1 and p[1] > t0]
        ms = [(b - a) * 1000 for a, b, _ in probes]
        return dict(probes=len(probes), p50_ms=_round(np.median(ms)) if ms else None,
                    max_ms=_round(max(ms)) if ms else None, not_200=sum(s != 200 for *_, s in probes))


class _Streams:
    """Completions of `tokens` tokens streamed one after another on a thread; each token's arrival time kept."""

    def __init__(self, url: str, tokens: int):
        self.url, self.tokens = url, tokens
        self.streams: list[list[float]] = []
        self.errors: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": self.tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        while not self.done.is_set():
            times: list[float] = []
            self.streams.append(times)
            try:
                with httpx.stream("POST", self.url + COMPLETIONS, json=body, timeout=300) as r:
                    if r.status_code != 200:
                        self.errors.append(f"HTTP {r.status_code}")
                        continue
                    for line in r.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                            times.append(time.perf_counter())
            except httpx.HTTPError as e:
                self.errors.append(f"{type(e).__name__}: {e}")

    def window(self, t0: float, t1: float) -> dict:
        """The gaps between two tokens of one stream whose later token came in [t0, t1]: largest and p50 in ms."""
        gaps = [(b - a) * 1000 for times in list(self.streams) for a, b in zip(times, times[1:]) if t0 <= b <= t1]
        return dict(gaps=len(gaps), p50_gap_ms=_round(np.median(gaps)) if gaps else None,
                    max_gap_ms=_round(max(gaps)) if gaps else None)

    def short(self) -> int:
        """Streams that ended before their `tokens` tokens (`done` lets the last one finish)."""
        return sum(len(times) != self.tokens for times in self.streams)


def _round(x: float) -> float:
    return round(float(x), 2)


def _post(url: str, path: str, body: bytes) -> tuple[int, float]:
    import httpx

    t = time.perf_counter()
    try:
        status = httpx.post(url + path, content=body, timeout=300,
                            headers={"content-type": "application/json"}).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.perf_counter() - t


def _send_all(url: str, bodies: list[tuple[str, bytes]], clients: int) -> tuple[list[int], list[float], float, float]:
    """Send `bodies` with `clients` in flight: (statuses, seconds each, window start, window end)."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda b: _post(url, *b), bodies))
    return [s for s, _ in answers], [s for _, s in answers], t0, time.perf_counter()


def _counts(statuses: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in sorted(statuses):
        out[str(s)] = out.get(str(s), 0) + 1
    return out


def _machine() -> dict:
    return dict(cpu_count=os.cpu_count(), loadavg=[round(x, 2) for x in os.getloadavg()],
                process_cpu_s=round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 2))


# --- the run -----------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    if args.random_bodies < 0 or args.stream_tokens < 2 or not args.health_interval > 0:
        raise ValueError(f"--random-bodies {args.random_bodies} --stream-tokens {args.stream_tokens} "
                         f"--health-interval {args.health_interval}: give N >= 0, N >= 2 and S > 0")
    before = _machine()
    groups = abusive_bodies(args.body_scale)
    rng = random.Random(args.seed)
    randoms = [random_body(rng) for _ in range(args.random_bodies)]
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qwen35-serve-stress-") as tok_dir:
        server = _Server(tok_dir, args.warmup, args.seed)
        warmup_s = server.start()
        health, streams = _Health(server.url, args.health_interval), _Streams(server.url, args.stream_tokens)
        try:
            health.thread.start()
            t0 = time.perf_counter()
            time.sleep(max(1.0, 20 * args.health_interval))  # the idle server: the floor of a /health probe here
            idle = dict(health=health.window(t0, time.perf_counter()), stream=streams.window(t0, t0))
            streams.thread.start()
            while not any(streams.streams) and not streams.errors:  # the stream is under way
                time.sleep(0.01)
            beside = []
            for name, bodies in groups.items():
                statuses, secs, t0, t1 = _send_all(server.url, bodies, len(bodies))
                beside.append(dict(name=name, bodies=len(bodies), bytes=sum(len(b) for _, b in bodies),
                                   statuses=_counts(statuses), answer_s=_round(max(secs)),
                                   health=health.window(t0, t1), stream=streams.window(t0, t1)))
            everything = [b for bodies in groups.values() for b in bodies]
            statuses, secs, t0, t1 = _send_all(server.url, everything, len(everything))
            together = dict(bodies=len(everything), statuses=_counts(statuses), last_answer_s=_round(max(secs)),
                            health=health.window(t0, t1), stream=streams.window(t0, t1))
            statuses, secs, t0, t1 = _send_all(server.url, randoms, 4)
            fuzz = dict(bodies=len(randoms), clients=4, statuses=_counts(statuses),
                        answer_p50_s=_round(np.median(secs)) if secs else None,
                        health=health.window(t0, t1), stream=streams.window(t0, t1))
            t_end = time.perf_counter()
        finally:
            streams.done.set()
            streams.thread.join(300)
            health.done.set()
            health.thread.join(60)
            server.stop()
    whole = dict(health=health.window(wall, t_end), stream=streams.window(wall, t_end))
    every = [int(s) for part in (*beside, together, fuzz) for s, k in part["statuses"].items() for _ in range(k)]
    failures = dict(server_errors=sum(s >= 500 or s == 0 for s in every), short_streams=streams.short(),
                    stream_errors=streams.errors[:5], health_not_200=whole["health"]["not_200"])
    doc = dict(machine=dict(before=before, after=_machine(), platform=platform.platform(),
                            python=platform.python_version()),
               server=dict(model="qwen3.5-tiny (random float32 weights)", in_process=True, warmup=args.warmup,
                           warmup_s=_round(warmup_s), streams=len(streams.streams), stream_tokens=args.stream_tokens,
                           health_interval_s=args.health_interval, body_scale=args.body_scale),
               idle=idle, beside_stream=beside, all_at_once=together, random_bodies=fuzz, whole_run=whole,
               failures=failures, wall_s=_round(time.perf_counter() - wall))
    _print(doc)
    bad = failures["server_errors"] or failures["short_streams"] or failures["health_not_200"]
    return doc | ({"exit_status": 1} if bad else {})


def _print(doc: dict) -> None:
    b, a = doc["machine"]["before"], doc["machine"]["after"]
    print(f"serve-stress: qwen3.5-tiny in this process, {b['cpu_count']} CPUs, load average {b['loadavg']} before, "
          f"{a['loadavg']} after; warm-up {doc['server']['warmup_s']} s")
    print(f"{'load':<28} {'bodies':>6} {'answer s':>9} {'health n':>8} {'p50 ms':>8} {'max ms':>8} "
          f"{'gap p50 ms':>10} {'gap max ms':>10}  statuses")
    rows = [("idle (no load)", None, None, doc["idle"])]
    rows += [(r["name"], r["bodies"], r["answer_s"], r) for r in doc["beside_stream"]]
    rows += [("all at once", doc["all_at_once"]["bodies"], doc["all_at_once"]["last_answer_s"], doc["all_at_once"]),
             ("random bodies (4 clients)", doc["random_bodies"]["bodies"], None, doc["random_bodies"]),
             ("whole run", None, doc["wall_s"], doc["whole_run"])]
    show = lambda x: "-" if x is None else x
    for name, n, secs, r in rows:
        h, s = r["health"], r["stream"]
        print(f"{name:<28} {show(n):>6} {show(secs):>9} {h['probes']:>8} {show(h['p50_ms']):>8} "
              f"{show(h['max_ms']):>8} {show(s['p50_gap_ms']):>10} {show(s['max_gap_ms']):>10}  "
              f"{r.get('statuses', '')}")
    f = doc["failures"]
    print(f"5xx or no answer: {f['server_errors']}, short streams: {f['short_streams']}, /health not 200: "
          f"{f['health_not_200']}")
