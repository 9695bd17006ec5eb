"""No body is answered 5xx: the inputs that once were (deep nesting, lone surrogates, odd chat_template_kwargs, ...)
and >= 2,000 generated ones (hypothesis) all get a 4xx in the OpenAI error shape or a 200, and the server answers
/health 200 after each batch (and, beside the inputs that once were 5xx, while they are processed). Generated
bodies ask for one token, so the few that are valid cost one engine step. How long /health took beside them is
measured by `python -m qwen35_lib.bench serve-stress`, never bounded here."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qwen35_lib.serve import protocol  # noqa: E402
from tests import serve_support  # noqa: E402
from tests.serve_support import MODEL  # noqa: E402

PATHS = ("/v1/completions", "/v1/chat/completions")
FIELDS = sorted(protocol.CHAT | protocol.COMPLETION | protocol.NO_EFFECT | set(protocol.REFUSED))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_support.running(tmp_path_factory.mktemp("tok")) as s:
        with httpx.Client(base_url=s.url, timeout=60) as client:
            yield s, client


def check(client: httpx.Client, path: str, content: bytes) -> int:
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, content[:300], r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    return r.status_code


def healthy(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200


NASTY = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": ' + b"[" * 5_000 + b"1" + b"]" * 5_000 + b"}",
    b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\ud800b", "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
    b'{"messages": [{"role": "user\\ud800", "content": "x"}], "max_tokens": 1}',
    b'{"prompt": [1], "max_tokens": 1, "user": "\\ud800"}',
    b'{"prompt": [1], "max_tokens": 1, "\\ud800": 1}',
    b"\xff\xfe{}", b"", b"null", b"[]", b"42", b'"x"', b"{", b'{"prompt": NaN}',
    b'{"prompt": [1], "temperature": NaN}', b'{"prompt": [1], "temperature": Infinity}',
    b'{"prompt": [1], "max_tokens": 1' + b"0" * 500 + b"}", b'{"prompt": [1], "top_k": 100000000000000000000000}',
    b'{"prompt": [1], "seed": -1}', b'{"prompt": [1], "seed": 1e400}', b'{"prompt": [1e400]}',
    b'{"prompt": [99999999999999999999999]}', b'{"prompt": [1], "stop_token_ids": [99999999999999999999]}',
    b'{"prompt": [1], "logit_bias": {"99999999999999999999999": 1}}', b'{"prompt": [1], "logit_bias": {"1": 1e308}}',
    b'{"prompt": [1], "truncate_prompt_tokens": 99999999999999999999}', b'{"prompt": [1], "model": 3}',
    b'{"prompt": [1], "stream_options": {"include_usage": "yes"}}', b'{"prompt": [1], "stream_options": 5}',
    b'{"prompt": [[]]}', b'{"prompt": [[1], "a", [true]]}', b'{"prompt": "' + b"x" * 100_000 + b'"}',
]
CHAT_KWARGS = [
    {"messages": [1]}, {"add_generation_prompt": "x"}, {"eos_token": 5}, {"enable_thinking": [1, 2]},
    {"raise_exception": 1}, {"range": None}, {"tojson": "x"}, {"x": {"y": [None, 1.5, "\u2028"]}},
    "not an object", [1, 2], 7,
]


def test_inputs_that_once_were_500(server):
    """Each a 4xx or a 200, while another client's /health keeps answering 200, answers coming back while the bodies
    are being processed (not only once they are all answered)."""
    s, client = server
    with serve_support.health_probes(s.url, 0.05) as health:
        t0 = time.perf_counter()
        send_nasty(client)
        t1 = time.perf_counter()
    assert all(status == 200 for _, status in health), [status for _, status in health if status != 200][:5]
    assert serve_support.answered_between(health, t0, t1) > 0


def send_nasty(client: httpx.Client) -> None:
    for path in PATHS:
        for content in NASTY:
            check(client, path, content)
        for kwargs in CHAT_KWARGS:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template_kwargs": kwargs}
            assert check(client, "/v1/chat/completions", json.dumps(body).encode()) in (200, 400)
        tpl = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for template in ("{{ 1 / 0 }}", "{% for %}", "{{ messages.__class__ }}", "{{ x.y.z }}", "{{ 'a' * 10**9 }}"):
            check(client, "/v1/chat/completions", json.dumps(tpl | {"chat_template": template}).encode())
        healthy(client)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)
PROMPT = st.lists(st.integers(-5, 300), min_size=0, max_size=6) | st.text(max_size=20) | JSON
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | JSON,
                                           "content": st.text(max_size=20) | JSON}), max_size=3) | JSON
BODY = st.tuples(
    st.sampled_from(PATHS),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), JSON, max_size=5),
    PROMPT, MESSAGES, st.booleans())


BATCH = 50  # /health is checked after every BATCH bodies
SETTINGS = settings(max_examples=2000, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


def test_fuzzed_bodies_never_get_a_5xx(server):
    """Hypothesis draws the bodies; they are sent in batches of BATCH, 8 at a time, /health after each batch."""
    s, client = server
    bodies = []

    @SETTINGS
    @given(item=BODY)
    def draw(item):
        path, fields, prompt, messages, stream = item
        body = fields | ({"messages": messages} if "chat" in path else {"prompt": prompt})
        body |= {"max_tokens": 1, "stream": stream}  # a valid body costs one step
        if "chat" in path:  # max_completion_tokens is a chat field: on /v1/completions it is refused as unknown
            body["max_completion_tokens"] = 1
        bodies.append((path, json.dumps(body).encode()))

    draw()
    assert len(bodies) >= 2000
    codes = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i in range(0, len(bodies), BATCH):
            codes += pool.map(lambda b: check(client, *b), bodies[i:i + BATCH])
            healthy(client)
    assert codes.count(400) > 0  # the fuzz reaches the refusals, and generation on both routes
    assert all(any(c == 200 for (p, _), c in zip(bodies, codes) if p == path) for path in PATHS)
