"""Bounds, fairness, metrics and the utility endpoints of the server.

Fairness: an 8 MB prompt, a 4,000-prompt request, a 1M-character prompt (tokenized in full, then too long) and
huge bad_words / stop lists are refused (400 naming the option) while a stream runs; parsing and tokenizing happen on
a worker thread (the tokenizer releasing the GIL), so the stream's tokens keep coming and /health keeps answering 200
while they are processed (both arrive between the first big request sent and the last answered), and every stream
gets all its tokens. How long the gaps between tokens and the /health answers were is measured by
`python -m qwen35_lib.bench serve-stress` (a JSON report beside the machine's load), never bounded here."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from qwen35_lib.serve import protocol  # noqa: E402
from qwen35_lib.versions import library_version  # noqa: E402
from tests import serve_support  # noqa: E402
from tests.serve_support import EC, MODEL, answered_between, health_probes  # noqa: E402


def test_big_requests_do_not_stall_a_stream_or_health(server):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "temperature": 0,
            "stream": True}
    httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": 4}, timeout=120)  # shapes compiled
    streams: list[list[float]] = []  # each stream's token times: streams follow each other until all are answered
    first, all_answered = threading.Event(), threading.Event()

    def stream():
        while not streams or not all_answered.is_set():
            streams.append([])
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["token_ids"]:
                        streams[-1].append(time.perf_counter())
                        first.set()

    streamer = threading.Thread(target=stream)
    with health_probes(server.url, 0.02) as health:
        streamer.start()
        assert first.wait(60)
        big = {"model": MODEL, "prompt": "x" * (8 << 20), "max_tokens": 1}
        many = {"model": MODEL, "prompt": [[7]] * 4000, "max_tokens": 1}
        answers, answered = {}, []

        def send(name, b):
            answers[name] = httpx.post(server.url + "/v1/completions", content=json.dumps(b), timeout=120,
                                       headers={"content-type": "application/json"})
            answered.append(time.perf_counter())

        # under --max-prompt-chars, so tokenized in full (seconds for this tokenizer), then over --max-model-len
        long = {"model": MODEL, "prompt": "x" * 1_000_000, "max_tokens": 1}
        # the outage: four ~4 MB bad_words lists, 20k bad words, 1M stop strings (each bounded: a 400)
        words = [{"model": MODEL, "prompt": [1], "bad_words": [f"word{i}" for i in range(k * 7, k * 7 + 400_000)]}
                 for k in range(4)]
        lists = [(f"bad_words{k}", b) for k, b in enumerate(words)] + [
            ("bad_words", {"model": MODEL, "prompt": [1], "bad_words": [f"w{i}" for i in range(20_000)]}),
            ("stop", {"model": MODEL, "prompt": [1], "stop": ["x"] * 1_000_000})]
        senders = [threading.Thread(target=send, args=a) for a in (("big", big), ("many", many), ("long", long),
                                                                    *lists)]
        sent = time.perf_counter()
        for t in senders:
            t.start()
        for t in senders:
            t.join(120)
        all_answered.set()
        streamer.join(120)
    assert answers["big"].status_code == 400 and "--max-prompt-chars" in answers["big"].json()["error"]["message"]
    assert answers["many"].status_code == 400
    assert "--max-prompts-per-request" in answers["many"].json()["error"]["message"]
    assert answers["long"].status_code == 400 and "--max-model-len" in answers["long"].json()["error"]["message"]
    for name, _ in lists:
        assert answers[name].status_code == 400 and "--max-" in answers[name].json()["error"]["message"], name
    assert len(answered) == len(senders)  # every big request answered (each client waits at most 120 s)
    assert all(len(times) == 120 for times in streams) and streams[-1][-1] > max(answered)
    # while the big requests were processed, the stream's tokens kept coming and /health kept answering
    during = sum(sent < t < max(answered) for times in streams for t in times)
    assert during > 0, "no token streamed between the first big request sent and the last answered"
    assert answered_between(health, sent, max(answered)) > 0, "no /health answer while the big requests ran"
    assert health and all(status == 200 for _, status in health), [s for _, s in health if s != 200][:5]


def test_body_size_and_prompt_count_bounds_name_their_option(tmp_path):
    limits = protocol.Limits(max_model_len=EC.max_model_len, max_prompts_per_request=3, max_request_bytes=2000,
                             max_prompt_chars=50)
    with serve_support.running(tmp_path, limits) as s:
        def err(body):
            r = httpx.post(s.url + "/v1/completions", content=json.dumps(body), timeout=60,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            return r.json()["error"]["message"]

        assert "--max-request-bytes 2000" in err({"prompt": [1] * 1000})
        assert "--max-prompts-per-request 3" in err({"prompt": [[1], [2], [3], [4]]})
        assert "--max-prompt-chars 50" in err({"prompt": "y" * 51})
        assert "--max-prompt-chars 50" in err({"prompt": ["a", "y" * 51]})
        assert "--max-model-len 128" in err({"prompt": [1] * 100, "max_tokens": 40})


def scrape(server) -> dict:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[key] = sample.value
    return out


def test_metrics_move_with_a_request(server):
    before = scrape(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in before
    prompt = [9, 8, 7, 6]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5,
                                                         "ignore_eos": True, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    after = scrape(server)
    delta = lambda k: after.get(k, 0) - before.get(k, 0)
    assert delta("vllm:prompt_tokens_total") == len(prompt)
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_success_total|finished_reason=length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:time_per_output_token_seconds_count") == delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert after["vllm:kv_cache_usage_perc"] == 0.0 and after["vllm:num_requests_running"] == 0


def test_utility_endpoints(server):
    get = lambda path: httpx.get(server.url + path)
    post = lambda path, body: httpx.post(server.url + path, json=body)
    assert get("/version").json()["version"] == library_version()  # qwen35_lib.versions, as everywhere
    assert get("/ping").status_code == 200 and httpx.post(server.url + "/ping").status_code == 200
    card = get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["max_model_len"] == EC.max_model_len
    missing = get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    t = post("/tokenize", {"model": MODEL, "prompt": "héllo"}).json()
    assert t["tokens"] == server.text.encode("héllo") and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == EC.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    chat = post("/tokenize", {"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == server.text.encode_chat(messages)
    assert post("/detokenize", {"model": MODEL, "tokens": t["tokens"]}).json()["prompt"] == "héllo"
    bad = post("/detokenize", {"tokens": [1, 999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post("/tokenize", {"prompt": 5}).status_code == 400


def test_engine_loop_admits_a_bounded_number_of_requests_between_steps():
    """A request with thousands of prompts is added 64 per step, so the steps of running streams go on between."""
    import asyncio

    from qwen35_lib.engine import SamplingParams
    from qwen35_lib.serve.loop import EngineLoop, Sink

    class Stub:
        added = 0

        def add_forks(self, prompt, params):
            Stub.added += 1
            return [Stub.added]

    loop = EngineLoop(Stub(), max_adds_per_step=64)  # not started: drain is called by hand
    aio = asyncio.new_event_loop()
    for i in range(200):
        loop.submit([1], SamplingParams(), Sink(aio, asyncio.Queue(), i))
    assert loop.drain() is True and Stub.added == 64
    assert loop.drain() and loop.drain() and Stub.added == 192
    assert loop.drain() is False and Stub.added == 200 and loop.prompt_tokens == 200
    aio.close()


def test_warmup_compiles_every_step_shape_before_health_is_ok(tmp_path):
    with serve_support.running(tmp_path, warmup="all") as s:
        deadline = time.time() + 300
        while (h := httpx.get(s.url + "/health")).status_code != 200:
            assert h.status_code == 503 and h.json()["status"] == "starting" and time.time() < deadline
            time.sleep(0.1)
        assert s.loop.warmed == len(s.loop.warmup) == 2 * len(s.engine.prefill_buckets)
        traces = s.engine.stats.traces
        for extra in ({}, {"logit_bias": {"5": 3}, "presence_penalty": 0.5}):
            r = httpx.post(s.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": list(range(3, 90)),
                                                                        "max_tokens": 3, **extra})
            assert r.status_code == 200, r.text
        assert s.engine.stats.traces == traces  # nothing compiled while serving


def test_background_compiles_serve_without_a_second_compile(tmp_path):
    """`--warmup background`: /health is ok before any shape is compiled here (no warm-up list), a background thread
    compiles the given shapes, and a request of those shapes then steps without tracing the step again; its tokens
    are the engine's run alone. `on_compiled` is called once the background is done (the compile-cache filler's
    cue)."""
    from qwen35_lib.engine import step as engine_module

    called = threading.Event()
    with serve_support.running(tmp_path / "tok", background=True, on_compiled=called.set) as s:
        assert s.health()["status"] == "ok"
        assert called.wait(600) and s.loop.compiled_in_background + len(s.loop._steps._seen) >= 1
        assert not s.loop._steps._pending  # every claimed shape released
        traces = engine_module.TRACES[0]
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3,
                                                        "temperature": 0, "ignore_eos": True}, timeout=120).json()
        assert engine_module.TRACES[0] == traces  # every shape of the request was compiled already
        assert r["choices"][0]["token_ids"] == s.alone([5, 6, 7], 3)


def test_on_ready_is_called_once_the_warm_up_is_done_before_on_compiled():
    """The compile-cache filler starts from on_ready (the warm-up's programs written first), else on_compiled."""
    import threading

    from qwen35_lib.serve.loop import EngineLoop

    class Stub:
        has_work = False
        compiled: list = []

        def precompile(self, buckets, processing):
            Stub.compiled += buckets

    calls, done = [], threading.Event()
    loop = EngineLoop(Stub(), warmup=[(1, 65, False), (1, 1, False)],
                      on_ready=lambda: calls.append(("ready", loop.ready, list(Stub.compiled))),
                      on_compiled=lambda: (calls.append(("compiled",)), done.set()))
    loop.start()  # after the name is bound: on_ready reads it
    assert done.wait(30)
    loop.stop()
    assert calls == [("ready", True, [(1, 65), (1, 1)]), ("compiled",)]
