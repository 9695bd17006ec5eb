"""`serve`: the OpenAI-compatible server on loopback, driven by the official `openai` client.

One server per module (`serve_support.running`: tiny random model, a byte-level tokenizer with a ChatML template,
an ephemeral 127.0.0.1 port), stopped by its fixture. References are the same prompts run alone through a fresh
`Engine` with the same weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serve_support import EC, GREEDY, MODEL, Server, prompts, wait_idle  # noqa: E402


# --- endpoints ---------------------------------------------------------------------------------------------------
def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = server.health()
    assert h["status"] == "ok" and h["free_pages"] == h["total_pages"] == EC.pages - 1


def test_completion_token_ids_and_text(server):
    client = server.client()
    ids = prompts(1, seed=1)[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    out = r.choices[0].token_ids
    assert out == server.alone(ids, 6)
    assert r.choices[0].text == server.text.decode(out) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 6, len(ids) + 6)
    assert r.object == "text_completion" and r.model == MODEL

    # text prompt, and a batch of prompts (one choice each, in order)
    r = client.completions.create(model=MODEL, prompt="héllo 世界", max_tokens=4, **GREEDY)
    assert r.choices[0].token_ids == server.alone(server.text.encode("héllo 世界"), 4)
    batch = prompts(3, seed=2)
    r = client.completions.create(model=MODEL, prompt=batch, max_tokens=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == [server.alone(p, 3) for p in batch]
    assert r.usage.prompt_tokens == sum(map(len, batch)) and r.usage.completion_tokens == 9


def test_completion_stream(server):
    ids = prompts(1, seed=3)[0]
    stream = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=7, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    tokens = [t for c in chunks for ch in c.choices for t in ch.token_ids]
    assert tokens == server.alone(ids, 7)
    pieces = [ch.text for c in chunks for ch in c.choices]
    assert "".join(pieces) == server.text.decode(tokens)
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_chat_plain_and_streamed(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🙂"}]
    ids = server.text.encode_chat(messages)
    expected = server.alone(ids, 5)
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].token_ids == expected
    assert r.choices[0].message.content == server.text.decode(expected)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 5

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                                 stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert [t for c in chunks for ch in c.choices for t in ch.token_ids] == expected
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == server.text.decode(expected)
    assert chunks[-1].choices[0].finish_reason == "length"

    # content as a list of text parts (as vllm bench serve's openai-chat backend may send it)
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=5, **GREEDY)
    assert r.choices[0].token_ids == expected


def test_32_concurrent_streams_equal_each_prompt_alone(server):
    batch = prompts(32, seed=4)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    steps0 = len(server.engine.stats.seqs)

    async def one(p):
        stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=8, stream=True, **GREEDY)
        return [t async for c in stream for ch in c.choices for t in ch.token_ids]

    async def main():
        return await asyncio.gather(*(one(p) for p in batch))

    outputs = asyncio.run(main())
    assert outputs == [server.alone(p, 8) for p in batch]
    assert max(server.engine.stats.seqs[steps0:]) == EC.max_num_seqs  # steps batched across the HTTP requests
    assert wait_idle(server)["free_pages"] == EC.pages - 1


# --- errors and disconnects ---------------------------------------------------------------------------------------
def _raw(server: Server, path: str, body) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 999]}, 400, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 500}, 400, "max_tokens"),  # > max_model_len
    ("/v1/completions", {"model": MODEL, "prompt": list(range(2, 100)), "max_tokens": 100}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1], "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": [1], "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": [1], "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "gpt-4", "prompt": [1]}, 404, "model"),
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = _raw(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


def test_bad_request_answered_400_while_others_continue(server):
    """Two streams are open (each has read its first event and holds the rest unread) while bad requests are
    answered 400; then both finish with the tokens they get alone."""
    client = server.client()
    good = prompts(2, seed=5)
    results: dict[int, list[int]] = {}
    opened = [threading.Event() for _ in good]
    bad_answered = threading.Event()

    def stream(i):
        s = iter(client.completions.create(model=MODEL, prompt=good[i], max_tokens=60, stream=True, **GREEDY))
        tokens = list(next(s).choices[0].token_ids)
        opened[i].set()
        bad_answered.wait(60)
        results[i] = tokens + [t for c in s for ch in c.choices for t in ch.token_ids]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in opened)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5, 999], max_tokens=4)
    assert e.value.status_code == 400 and "outside the vocabulary" in e.value.message
    assert e.value.body["param"] == "prompt" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="max-model-len"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert not results  # both streams still open
    bad_answered.set()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(2)] == [server.alone(p, 60) for p in good]


def test_disconnect_frees_pages(server):
    total = EC.pages - 1
    assert wait_idle(server)["free_pages"] == total
    aborted = server.health()["aborted"]
    body = {"model": MODEL, "prompt": prompts(1, seed=6)[0], "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = (line for line in r.iter_lines() if line)  # SSE: "data: {...}" lines, blank-line separated
        for _ in range(3):
            assert next(events).startswith("data: {")
        h = server.health()
        assert h["running"] == 1 and h["free_pages"] < total  # holding pages while it streams
    h = wait_idle(server)  # the connection is closed mid-stream
    assert h["free_pages"] == total and h["aborted"] == aborted + 1

    # not streamed: the client gives up waiting (110 steps take far longer than 50 ms)
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": 110},
                   timeout=httpx.Timeout(10.0, read=0.05))
    h = wait_idle(server)
    assert h["free_pages"] == total and h["aborted"] == aborted + 2


# --- the subcommand ---------------------------------------------------------------------------------------------
def test_cli_serve_subprocess():
    """`python -m qwen35_lib serve --port 0`: prints where it listens, answers, stops on SIGTERM (uvicorn shuts down,
    then re-raises the signal, so the exit status is -SIGTERM)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "qwen35_lib", "serve", "--port", "0", "--max-num-seqs", "1",
           "--max-num-batched-tokens", "64", "--max-model-len", "64", "--page-size", "8", "--dtype", "float32",
           "--warmup", "plain", "--compile-cache", "off", "--shutdown-timeout", "2"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"serving qwen3\.5-tiny on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m[1]
                break
        assert url, "no '# serving' line"
        deadline = time.time() + 120
        while True:  # 503 "starting" while the warm-up compiles the step's shapes, then 200
            try:
                r = httpx.get(url + "/health")
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["status"] == "starting", r.text
            except httpx.ConnectError:
                pass
            assert time.time() < deadline
            time.sleep(0.1)
        assert proc.poll() is None
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == "qwen3.5-tiny"
        r = client.completions.create(model="qwen3.5-tiny", prompt=[3, 4, 5], max_tokens=1, temperature=0)
        assert len(r.choices[0].token_ids) == 1 and r.choices[0].text == ""  # a random preset has no tokenizer
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            client.completions.create(model="qwen3.5-tiny", prompt="text", max_tokens=1)
        # SIGTERM while a stream is open: it may finish for --shutdown-timeout (2 s), then the server exits
        opened = threading.Event()

        def stream():
            try:
                body = {"model": "qwen3.5-tiny", "prompt": [3, 4], "max_tokens": 60, "ignore_eos": True,
                        "stream": True}
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        opened.set()
            except httpx.HTTPError:
                pass

        threading.Thread(target=stream, daemon=True).start()
        assert opened.wait(60)
    finally:
        t = time.time()
        proc.terminate()
        assert proc.wait(60) == -signal.SIGTERM
        assert time.time() - t < 30


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "99999 is not a port"), (["--max-num-seqs", "0"], "0 must be at least 1"),
    (["--max-prompts-per-request", "-4"], "-4 must be at least 1"), (["--port", "x"], "'x' is not a port"),
])
def test_cli_serve_refuses_bad_sizes_in_one_line(flags, message, capsys):
    _one_line_refusal(["serve", *flags], message, capsys)


@pytest.mark.parametrize("flags, message", [
    (["--bench", "--concurrency", "-4"], "-4 must be at least 1"), (["--stage", "kernels", "--isl", "0"],
                                                                     "0 must be at least 1"),
    (["--stage", "kernels", "--port", "99999"], "99999 is not a port"),
])
def test_cli_recipe_refuses_bad_sizes_in_one_line(flags, message, capsys):
    _one_line_refusal(["recipe", *flags], message, capsys)


def _one_line_refusal(argv: list[str], message: str, capsys=None) -> None:
    """The argument parser refuses in one line with exit status 2 (in-process: no server or model is started)."""
    from qwen35_lib.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
