"""Reasoning and tool-call parsing (`--reasoning-parser qwen3`, `--enable-auto-tool-choice --tool-call-parser
hermes`): a server whose step is scripted (`serve_support.scripted_step`: the answer's tokens chosen here, through the
real scheduler, loop and server), its messages against the same answer run through the engine directly and split by
the definition (str.partition), streamed and not."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qwen35_lib.engine import Engine, SamplingParams  # noqa: E402
from qwen35_lib.serve import parsers, protocol  # noqa: E402
from tests import serve_support  # noqa: E402
from tests.serve_support import EC, MODEL  # noqa: E402

MESSAGES = [{"role": "user", "content": "weather?"}]
ANSWER = 'Hm.</think>It:<tool_call>{"name": "f", "arguments": {"c": 1}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
SCRIPT: dict[int, int] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    limits = protocol.Limits(max_model_len=EC.max_model_len, reasoning_parser="qwen3", tool_call_parser="hermes")
    with serve_support.running(tmp_path_factory.mktemp("tok"), limits,
                               step_fn=serve_support.scripted_step(SCRIPT)) as s:
        prompt = s.text.encode_chat(MESSAGES)
        SCRIPT.update({len(prompt) + i: t for i, t in enumerate(s.text.encode(ANSWER))})
        yield s


def _engine_answer(server) -> str:
    """The scripted answer run through an engine directly (the same stand-in step), as text."""
    e = Engine(server.config, server.weights, EC)
    e.step_fn = server.engine.step_fn
    prompt = server.text.encode_chat(MESSAGES)
    n = len(server.text.encode(ANSWER))
    return server.text.decode(e.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].output_ids)


def _post(server, body: dict, stream: bool = False):
    n = len(server.text.encode(ANSWER))
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": n, "ignore_eos": True, "temperature": 0} | body
    if not stream:
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_reasoning_and_tool_calls_split_as_the_definition(server):
    text = _engine_answer(server)
    assert text == ANSWER
    reasoning, _, rest = text.partition("</think>")
    r = _post(server, {})
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    assert m["reasoning_content"] == m["reasoning"] == reasoning and m["content"] == rest
    # with tools: the call parsed, the content before it, finish_reason tool_calls
    r = _post(server, {"tools": TOOLS}).json()["choices"][0]
    m = r["message"]
    call = json.loads(rest[rest.index("<tool_call>") + 11:rest.index("</tool_call>")])
    assert m["content"] == rest[:rest.index("<tool_call>")] and r["finish_reason"] == "tool_calls"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]] == \
        [("function", call["name"], call["arguments"])]
    # tool_choice none: no parsing; include_reasoning false: no reasoning
    m = _post(server, {"tools": TOOLS, "tool_choice": "none", "include_reasoning": False}).json()["choices"][0]
    assert m["message"]["content"] == rest and "reasoning_content" not in m["message"]
    for body, param in (({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
                         "tool_choice"), ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                        ({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice")):
        r = _post(server, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_streamed_tool_calls_equal_the_whole_answers(server):
    whole = _post(server, {"tools": TOOLS}).json()["choices"][0]
    chunks = _post(server, {"tools": TOOLS}, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [t["index"] for t in calls] == list(range(len(whole["message"]["tool_calls"]))) != []
    assert [t["function"] for t in calls] == [t["function"] for t in whole["message"]["tool_calls"]]
    assert "".join(d.get("content") or "" for d in deltas) == (whole["message"]["content"] or "")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" == whole["finish_reason"]


@pytest.mark.parametrize("text", ['hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> x <tool_call>'
                                  '{"name": "g"}</tool_call>', "no calls <tool_call>", "a <tool_call>bad</tool_call>",
                                  '<tool_call>{"name": "f"}</tool_call><tool_call>{"name"', "<tool_c", ""])
def test_tool_call_stream_equals_the_whole_split_at_every_cut(text):
    whole_content, whole_calls = parsers.split_tool_calls(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut], text[cut:cut + 3], text[cut + 3:]]):
            s = parsers.ToolCallStream()
            outs = [s.push(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
            calls = [c for _, cs in outs for c in cs]
            assert "".join(c for c, _ in outs) == (whole_content or ""), cut
            assert [c["function"] for c in calls] == [c["function"] for c in whole_calls], cut
            assert [c["index"] for c in calls] == list(range(len(calls)))


def test_streamed_reasoning_deltas_add_up(server):
    chunks = _post(server, {}, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    want_r, _, want_c = ANSWER.partition("</think>")
    assert (reasoning, content) == (want_r, want_c)
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


@pytest.mark.parametrize("text", [ANSWER, "<think>a</think>b", "no end tag", "<think>open only", "x</thi", "",
                                  "a</think>", "</think>b"])
def test_reasoning_stream_equals_the_whole_split_at_every_cut(text):
    """Fed in pieces cut anywhere, the streamed split adds up to the whole answer's split (vLLM's streaming
    semantics: before </think> is reasoning even without one, so only texts with </think> are compared whole)."""
    whole_r, whole_c = parsers.split_reasoning(text)
    for cut in range(len(text) + 1):
        s = parsers.ReasoningStream()
        parts = [s.push(text[:cut]), s.push(text[cut:], final=True)]
        r, c = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        if "</think>" in text:
            assert (r, c or None) == (whole_r, whole_c), cut
        else:
            assert (r, c) == (text.removeprefix("<think>"), ""), cut
    assert parsers.split_tool_calls("hi <tool_call>not json</tool_call>") == ("hi <tool_call>not json</tool_call>",
                                                                             [])


@pytest.mark.parametrize("text", ['[{"name": "f", "parameters": {"a": "}]\\"{"}}, {"name": "g"} ]',
                                  ' [ {"name":"h","parameters":{"b":[1,{"c":2}]}}]', '[{"name": "f", "param'])
def test_forced_tool_stream_sends_each_complete_call_at_every_cut(text):
    """A "required" answer fed in two pieces cut anywhere: each call once its object is complete, as the whole
    answer's calls; a named function's arguments are the answer's pieces."""
    from qwen35_lib.serve.structured import forced_tool_calls

    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in forced_tool_calls(text, "required")[1]]
    for cut in range(len(text) + 1):
        s = parsers.ForcedToolStream("required")
        deltas = s.push(text[:cut]) + s.push(text[cut:])
        assert [d["index"] for d in deltas] == list(range(s.calls))
        got = [(d["function"]["name"], d["function"]["arguments"]) for d in deltas]
        assert got == whole, cut
        s = parsers.ForcedToolStream("f")
        deltas = s.push(text[:cut]) + s.push(text[cut:])
        assert deltas[0]["function"]["name"] == "f" and deltas[0]["type"] == "function" and s.calls == 1
        assert "".join(d["function"]["arguments"] for d in deltas) == text
