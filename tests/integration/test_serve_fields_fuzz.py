"""Random request bodies: every field the server knows (and some it does not) with values of every JSON type, in
and out of range, sent by four clients at once. No answer is a 5xx, every refusal has the OpenAI error shape and
names a field, /health keeps answering 200 while they are processed, and the pools are back to idle at the end.
How long /health took meanwhile is measured by `python -m qwen35_lib.bench serve-stress` (its `random_bodies`), never
bounded here."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qwen35_lib.serve import protocol  # noqa: E402
from tests import serve_support  # noqa: E402
from tests.serve_support import EC, MODEL, answered_between, health_probes, wait_idle  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # the serve tests' shared server (tests/serve/conftest.py), for this module
    with serve_support.running(tmp_path_factory.mktemp("tok")) as s:
        yield s

VALUES = [None, True, False, 0, 1, 2, -1, 3.5, -0.5, 2**63, -2**70, 1e308, "", "x", "NaN", "\ud800", "a" * 5000,
          [], [1, 2], ["a"], [[1]], [None], [3, -1], {}, {"1": 1}, {"7": 100}, {"a": {"b": []}}, {"x": "y"}]
PROMPTS = [[1, 2, 3], "hi", [], [[1], [2, 3]], 5, None, [300], ["a", [4]], "\x00"]
MESSAGES = [[{"role": "user", "content": "hi"}], [], [{"role": 3}], "hi", [{"role": "user", "content": [1]}]]
SMALL = [None, 0, 1, 2, -1, 10**9, "5", 3.0]


def body(rng: random.Random, chat: bool) -> dict:
    fields = sorted((protocol.CHAT if chat else protocol.COMPLETION) | protocol.NO_EFFECT | set(protocol.REFUSED))
    sane = rng.random() < 0.7  # most bodies start valid, so that the fields are also exercised past the parser
    doc = {"model": MODEL, "max_tokens": rng.choice([1, 2, 4] if sane else SMALL)}
    doc["messages" if chat else "prompt"] = (MESSAGES if chat else PROMPTS)[0] if sane else \
        rng.choice(MESSAGES if chat else PROMPTS)
    for name in rng.sample(fields, rng.randint(0, 3 if sane else 6)):
        if name in ("model", "prompt", "messages"):
            continue
        doc[name] = rng.choice(SMALL if name in ("n", "best_of", "logprobs", "top_logprobs", "max_tokens",
                                                 "prompt_logprobs", "min_tokens") else VALUES)
    if rng.random() < 0.05:
        doc["no_such_field"] = 1
    return doc


def test_random_bodies_never_get_a_server_error(server):
    rng = random.Random(52)
    count = int(os.environ.get("QWEN35_FUZZ_BODIES", "300"))  # the acceptance run: 4000
    bodies = [(c, body(rng, c)) for c in (rng.random() < 0.4 for _ in range(count))]
    def send(item):
        chat, doc = item
        path = "/v1/chat/completions" if chat else "/v1/completions"
        r = httpx.post(server.url + path, content=json.dumps(doc), timeout=300,
                       headers={"content-type": "application/json"})
        return doc, r.status_code, r.text

    with health_probes(server.url, 0.05) as health, concurrent.futures.ThreadPoolExecutor(4) as pool:
        t0 = time.perf_counter()
        answers = list(pool.map(send, bodies))
        t1 = time.perf_counter()
    codes = {}
    for doc, status, text in answers:
        codes[status] = codes.get(status, 0) + 1
        assert status < 500, (doc, text[:300])
        if status != 200:
            err = json.loads(text)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (doc, err)
    print(f"status codes of {count} random bodies: {codes}")
    assert codes.get(200, 0) > count // 10 and codes.get(400, 0) > count // 3, codes  # both kinds exercised
    assert all(status == 200 for _, status in health), [status for _, status in health if status != 200][:5]
    assert answered_between(health, t0, t1) > 0  # /health answered while the bodies were processed
    assert wait_idle(server)["free_pages"] == EC.pages - 1
