"""`serve.request`: a validated request into prompts and sampling parameters, without a server: the checks a
field's type cannot make (the server's bounds, one field against another), each a 400 naming the field. The
fields' effects on the output are tested through the server (test_protocol.py)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("pydantic")

from qwen35_lib.serve import protocol, request  # noqa: E402

LIMITS = protocol.Limits(max_model_len=64, max_logprobs=5, eos_token_ids=(2,))


def refused(body: dict, chat: bool = False, limits: protocol.Limits = LIMITS) -> protocol.APIError:
    with pytest.raises(protocol.APIError) as e:
        request.parse(body, None, chat, limits)
    return e.value


def test_token_id_prompts_become_choices():
    p = request.parse({"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 4, "temperature": 0, "seed": 9,
                       "stop_token_ids": [7, 7], "top_k": -1}, None, False, LIMITS)
    assert p.prompts == [[1, 2], [3]] and len(p.params) == 4 and p.prompt_of(3) == [3]
    assert [sp.seed for sp in p.params[:2]] == [9, request.sample_seed(9, 1)]
    sp = p.params[0]
    assert (sp.max_new_tokens, sp.temperature, sp.top_k, sp.stop_token_ids) == (4, 0.0, 0, (7, 2))
    assert p.stop_ids == (7,) and not p.stream and not p.scored
    echo = request.parse({"prompt": [1], "max_tokens": 0, "echo": True, "logprobs": 1}, None, False, LIMITS)
    assert echo.params == [None] and echo.scored and echo.echo
    ignore = request.parse({"prompt": [1], "ignore_eos": True}, None, False, LIMITS)
    assert ignore.params[0].stop_token_ids == () and ignore.params[0].max_new_tokens == 16


def test_the_checks_between_fields_and_against_the_bounds():
    cases = [({"best_of": 2}, "best_of", "`best_of` other than `n`"),
             ({"logprobs": 6}, "logprobs", "[0, 5] (--max-logprobs)"),
             ({"logprobs": 1, "stream": True}, "logprobs", "send stream: false"),
             ({"max_tokens": 0}, "max_tokens", "0 only with `echo`"),
             ({"max_tokens": 64}, "max_tokens", "leaves no room for a prompt within --max-model-len 64"),
             ({"prompt": list(range(60)), "max_tokens": 8}, "prompt", "exceeds --max-model-len 64"),
             ({"prompt": "text"}, "prompt", "no tokenizer"), ({"stop": "x"}, "stop", "need a tokenizer"),
             ({"min_p": 2.0}, "min_p", "min_p"), ({"n": 2000}, "n", "--max-prompts-per-request")]
    for extra, param, message in cases:
        e = refused({"prompt": [1, 2]} | extra)
        assert e.param == param and message in e.message, (extra, e)
    chat = [({"top_logprobs": 2}, "top_logprobs", "needs `logprobs`: true"),
            ({"echo": True}, "echo", "use /v1/completions"),
            ({"tool_choice": "auto"}, "tool_choice", "needs `tools`"),
            ({"tools": [{"function": {"name": "f"}}]}, "tools", "--enable-auto-tool-choice"),
            ({"tools": [{"function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}}, "tool_choice",
             "not in `tools`"),
            ({"max_completion_tokens": 0}, "max_completion_tokens", "must be >= 1")]
    for extra, param, message in chat:
        e = refused({"messages": [{"role": "user", "content": "x"}]} | extra, chat=True)
        assert e.param == param and message in e.message, (extra, e)


def test_tool_choices():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = protocol.read_request({"messages": [{"role": "user", "content": "x"}], "tools": tools}, True,
                                protocol.Limits(max_model_len=64, tool_call_parser="hermes"))
    assert request._tools(req, protocol.Limits(max_model_len=64, tool_call_parser="hermes")) == (True, None)
    for choice, want in (("none", (False, None)), ("required", (False, "required")),
                         ({"type": "function", "function": {"name": "f"}}, (False, "f"))):
        req = protocol.read_request({"messages": [{"role": "u"}], "tools": tools, "tool_choice": choice}, True, LIMITS)
        assert request._tools(req, LIMITS) == want
    assert req.tools[0].model_dump(exclude_unset=True) == tools[0]  # the template sees them as sent


def test_unknown_fields_can_be_ignored():
    body = {"prompt": [1, 2], "max_tokens": 1, "frobnicate": True}
    assert refused(body).param == "frobnicate"
    lenient = protocol.Limits(max_model_len=64, ignore_unknown_fields=True)
    assert request.parse(body, None, False, lenient).prompts == [[1, 2]]


def test_seeds_fold_to_32_bits():
    assert request.fold_seed(7) == 7 and request.fold_seed(2**32 + 1) == 0 and request.fold_seed(-1) == 0
    assert request.sample_seed(5, 0) == 5 and request.sample_seed(5, 1) != request.sample_seed(5, 2)


def test_encode_batches_and_the_tokenizers_failure_is_the_inputs():
    tok = types.SimpleNamespace(encode_batch=lambda texts, add_special_tokens: [
        types.SimpleNamespace(ids=[len(t), int(add_special_tokens)]) for t in texts])
    assert request.encode(types.SimpleNamespace(tokenizer=tok), "abc", True) == [3, 1]

    def broken(texts, add_special_tokens):
        raise RuntimeError("bad input")

    with pytest.raises(protocol.APIError, match="could not encode the prompt: RuntimeError: bad input"):
        request.encode(types.SimpleNamespace(tokenizer=types.SimpleNamespace(encode_batch=broken)), "x", False)
