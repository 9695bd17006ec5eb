"""`serve.structured`: structured outputs on the server (response_format, vLLM's structured_outputs and guided_*),
each answer checked against the engine run directly with the same grammar (`Server.alone`), plain requests beside
them untouched, and every malformed, doubled or oversized constraint refused with a 400 naming its field."""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from qwen35_lib.serve import structured  # noqa: E402
from qwen35_lib.serve.protocol import APIError, Limits  # noqa: E402
from tests.serve_support import MODEL, prompts  # noqa: E402

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
PROMPT = "Answer in JSON: "
LIMITS = Limits(max_model_len=128)


def post(server, body: dict, chat: bool = False) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(server.url + path, json={"model": MODEL} | body, timeout=300)


def grammar_of(server, body: dict):
    """The grammar the server compiles for `body` (the same spec, tokenizer and EOS ids)."""
    grammars = structured.Grammars(server.text, server.config.vocab_size, server.config.eos_token_ids)
    return grammars.compile(structured.parse_spec(body, LIMITS))


def body_text(server, ids: list[int]) -> str:
    """A choice's text without its EOS token (the tiny model's EOS id is a byte of the test tokenizer)."""
    assert ids[-1] in server.config.eos_token_ids, ids
    return server.text.decode(ids[:-1])


def test_a_json_schema_answer_validates_and_equals_the_engine_with_the_same_mask(server):
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                                      "strict": True}}}
    for seed in (0, 1):  # sampled (vLLM's flexible JSON whitespace): a seed each
        r = post(server, {"prompt": PROMPT, "max_tokens": 80, "seed": seed} | fmt)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(body_text(server, choice["token_ids"])), SCHEMA)
        want = server.alone(server.text.encode(PROMPT), 80, ignore_eos=False, temperature=1.0, seed=seed,
                            structured=grammar_of(server, fmt))
        assert choice["token_ids"] == want
    # vLLM's structured_outputs, greedy, without free whitespace: the compact form
    so = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    r = post(server, {"prompt": PROMPT, "max_tokens": 60, "temperature": 0} | so)
    ids = r.json()["choices"][0]["token_ids"]
    assert re.fullmatch(r'\{"answer":"(yes|no)","n":\d\}', body_text(server, ids)), ids
    assert ids == server.alone(server.text.encode(PROMPT), 60, ignore_eos=False, structured=grammar_of(server, so))


def test_chat_choices_regex_and_streaming_follow_their_grammar(server):
    r = post(server, {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 10, "n": 3, "temperature": 1,
                      "seed": 5, "guided_choice": ["red", "green", "blue"]}, chat=True)
    assert r.status_code == 200, r.text
    assert {c["message"]["content"].rstrip("\x04") for c in r.json()["choices"]} <= {"red", "green", "blue"}
    r = post(server, {"prompt": "id: ", "max_tokens": 12, "temperature": 0, "guided_regex": r"[a-c]{3}-[0-9]{2}"})
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", body_text(server, r.json()["choices"][0]["token_ids"])), r.text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True, "temperature": 0,
            "structured_outputs": {"choice": ["alpha", "beta"]}}) as s:
        ids = [t for line in s.iter_lines() if line.startswith("data: {")
               for t in json.loads(line[6:])["choices"][0]["token_ids"]]
    assert body_text(server, ids) in ("alpha", "beta")
    r = post(server, {"prompt": "x", "max_tokens": 8, "temperature": 0, "guided_grammar": 'start: "ab" | "cd"',
                      "guided_decoding_backend": "guidance"})
    assert body_text(server, r.json()["choices"][0]["token_ids"]) in ("ab", "cd"), r.text


def test_plain_requests_beside_structured_ones_are_untouched(server):
    plain = prompts(3, seed=11)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        guided = [pool.submit(post, server, {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                             "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
                  for _ in range(3)]
        free = [pool.submit(post, server, {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
                for p in plain]
        for f in guided:
            assert f.result().status_code == 200
        for p, f in zip(plain, free):
            assert f.result().json()["choices"][0]["token_ids"] == server.alone(p, 10)


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}}},
     "response_format", "frob"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": [1, 2]}, "guided_json", "object"),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured-output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "response_format"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choise": ["a"]}}, "structured_outputs", "choise"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}}, "structured_outputs",
     "true or false"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend", "llguidance"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON"),
    ({"guided_choice": ["x" * 70_000]}, "guided_choice", "--max-grammar-bytes 65536"),
    ({"guided_json": {"enum": [str(i) for i in range(20_000)]}}, "guided_json", "--max-grammar-bytes"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(server, fields, param, words):
    for chat in (False, True):
        body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "x"}
        r = post(server, body | {"max_tokens": 4} | fields, chat)
        assert r.status_code == 400, (fields, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    assert server.health()["status"] == "ok"


def test_specs_and_the_grammar_cache():
    assert structured.parse_spec({"response_format": {"type": "text"}}, LIMITS) is None
    assert structured.parse_spec({"guided_decoding_backend": "auto"}, LIMITS) is None
    spec = structured.parse_spec({"structured_outputs": {"json": {"type": "object", "properties": {
        "a": {"type": "object"}}}, "disable_additional_properties": True}}, LIMITS)
    assert spec.spec == {"type": "object", "additionalProperties": False,
                         "properties": {"a": {"type": "object", "additionalProperties": False}}}
    ws = structured.parse_spec({"guided_json": "{}", "guided_whitespace_pattern": " ?"}, LIMITS)
    assert (ws.kind, ws.spec, ws.whitespace_pattern) == ("json", {}, " ?")
    small = Limits(max_model_len=128, max_grammar_bytes=40)
    with pytest.raises(APIError, match="--max-grammar-bytes 40") as e:
        structured.parse_spec({"guided_regex": "a" * 50}, small)
    assert e.value.param == "guided_regex"
    with pytest.raises(APIError, match="need a tokenizer"):
        structured.Grammars(None, 256, (1,)).compile(ws)


def test_the_compiled_grammar_is_cached_by_spec(server):
    grammars = structured.Grammars(server.text, server.config.vocab_size, server.config.eos_token_ids, cache_size=2)
    spec = lambda r: structured.parse_spec({"guided_regex": r}, LIMITS)
    a = grammars.compile(spec("a+"))
    assert grammars.compile(spec("a+")) is a
    grammars.compile(spec("b+"))
    grammars.compile(spec("c+"))  # the oldest dropped
    assert grammars.compile(spec("a+")) is not a


# --- under a reasoning parser: the reasoning free, the answer after </think> constrained (as vLLM) -------------------
@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    from tests import serve_support

    with serve_support.running(tmp_path_factory.mktemp("tok"), Limits(max_model_len=128,
                                                                      reasoning_parser="qwen3")) as s:
        yield s


def test_under_a_reasoning_parser_the_grammar_starts_after_the_reasoning(thinking):
    s = thinking
    choice = {"guided_choice": ["no", "maybe"]}
    ask = [{"role": "user", "content": "pick"}]
    assert structured.reasoning_marker(s.text, s.text.encode_chat(ask)) == tuple(s.text.encode("</think>"))
    r = post(s, {"messages": ask, "max_tokens": 12, "temperature": 0} | choice, chat=True)
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    prompt = s.text.encode_chat(ask)
    assert ids == s.alone(prompt, 12, ignore_eos=False)  # no </think> yet: every token free
    assert ids == s.alone(prompt, 12, ignore_eos=False,
                          structured=grammar_of(s, choice).after(structured.reasoning_marker(s.text, prompt)))
    # a prompt whose reasoning is over (the template closed it): the grammar from the first token
    done = ask + [{"role": "assistant", "content": "<think>hm</think>"}]
    prompt = s.text.encode_chat(done, add_generation_prompt=False)
    prompt = prompt[:len(s.text.encode_chat(done[:1])) + len(s.text.encode("<think>hm</think>"))]
    assert structured.reasoning_marker(s.text, prompt) is None
    r = post(s, {"messages": done, "continue_final_message": True, "add_generation_prompt": False,
                 "max_tokens": 12, "temperature": 0} | choice, chat=True)
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert body_text(s, ids) in ("no", "maybe")
    assert ids == s.alone(prompt, 12, ignore_eos=False, structured=grammar_of(s, choice))


# --- tool_choice "required" or a named function: the answer is the calls' JSON (as vLLM) --------------------------
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
             "additionalProperties": False}}},
         {"type": "function", "function": {"name": "time"}}]


def test_a_forced_tool_choice_answers_with_calls_that_follow_the_tools(server):
    ask = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "max_tokens": 90, "seed": 2}
    prompt = server.text.encode_chat(ask["messages"], tools=TOOLS)
    named = ask | {"tool_choice": {"type": "function", "function": {"name": "weather"}}}
    r = post(server, named, chat=True)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["message"]["content"] == ""  # vLLM: a named call ends "stop"
    [call] = c["message"]["tool_calls"]
    assert call["function"]["name"] == "weather" and call["type"] == "function"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])
    assert c["token_ids"] == server.alone(prompt, 90, ignore_eos=False, temperature=1.0, seed=2,
                                          structured=grammar_of(server, named))
    named_choice = c
    required = ask | {"tool_choice": "required", "seed": 6}  # a seed whose sampled whitespace ends within 90
    r = post(server, required, chat=True)
    c = r.json()["choices"][0]
    assert c["token_ids"] == server.alone(prompt, 90, ignore_eos=False, temperature=1.0, seed=6,
                                          structured=grammar_of(server, required))
    calls = json.loads(body_text(server, c["token_ids"]))
    jsonschema.validate(calls, structured.tool_schema(TOOLS, "required"))
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == ""
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c["message"]["tool_calls"]] \
        == [(x["name"], x["parameters"]) for x in calls]
    for body, want in ((named, named_choice), (required, c)):  # streamed: the same calls, as deltas
        chunks = stream_chat(server, body)
        deltas = [d for x in chunks for d in x["choices"][0]["delta"].get("tool_calls", [])]
        got: dict = {}  # index -> [name, arguments]: the streamed deltas joined as a client joins them
        for d in deltas:
            entry = got.setdefault(d["index"], [None, ""])
            entry[0] = d["function"].get("name") or entry[0]
            entry[1] += d["function"].get("arguments", "")
        assert [(n, json.loads(a)) for n, a in got.values()] == \
            [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in want["message"]["tool_calls"]]
        assert [t for x in chunks for t in x["choices"][0]["token_ids"]] == want["token_ids"]
        assert chunks[-1]["choices"][0]["finish_reason"] == want["finish_reason"]
        assert not "".join(x["choices"][0]["delta"].get("content") or "" for x in chunks)
    for bad, words in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in `tools`"),
                       ({"tool_choice": "required", "guided_regex": "a"}, "one structured-output constraint")):
        r = post(server, ask | bad, chat=True)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def stream_chat(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "stream": True} | body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_tool_schemas():
    assert structured.tool_schema(TOOLS, {"type": "function", "function": {"name": "time"}}) == \
        {"type": "object", "properties": {}}
    defs = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "$defs": {"a": d}}}}
            for n, d in (("f", {"type": "string"}), ("g", {"type": "string"}))]
    assert structured.tool_schema(defs, "required")["$defs"] == {"a": {"type": "string"}}
    defs[1]["function"]["parameters"]["$defs"]["a"] = {"type": "integer"}
    with pytest.raises(APIError, match="twice"):
        structured.tool_schema(defs, "required")
    assert structured.forced_tool_calls("[1", "required") == ("[1", [])
    assert structured.forced_tool_calls('{"x"', "f")[1][0]["function"]["arguments"] == '{"x"'  # cut: as it is
    assert structured.forced_tool_calls(' [{"name": "f", "parameters": {}}]\x04', "required")[1][0]["function"] \
        == {"name": "f", "arguments": "{}"}
    assert structured.forced_tool_calls('{"x": 1}', "f")[1][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
