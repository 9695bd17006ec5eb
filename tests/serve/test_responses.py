"""`serve.responses`: the OpenAI response objects (the server's tests read them through the official client)."""

from __future__ import annotations

from qwen35_lib.serve import responses


def test_a_response_and_its_choices():
    use = responses.usage(3, 2)
    assert use == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    c = responses.choice(0, False, "ab", [7, 8], "stop", stop_reason="b", prompt_logprobs=[None])
    assert c["text"] == "ab" and c["token_ids"] == [7, 8] and c["prompt_logprobs"] == [None]
    m = responses.choice(1, True, None, [9], "tool_calls", message={"tool_calls": [{"id": "x"}]})
    assert m["message"] == {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]} and "text" not in m
    doc = responses.response(responses.new_id(True, "r1"), "m", True, [m], use)
    assert doc["id"] == "chatcmpl-r1" and doc["object"] == "chat.completion" and doc["usage"] == use
    assert responses.new_id(False).startswith("cmpl-") and responses.FINISH["eos"] == "stop"


def test_streamed_chunks():
    first = responses.chunk("r", "m", True, 0, "", [], None, role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["object"] == \
        "chat.completion.chunk"
    last = responses.chunk("r", "m", True, 0, None, [], "stop", stop_reason=5, reasoning="hm")
    assert last["choices"][0]["delta"] == {"reasoning_content": "hm", "reasoning": "hm"}
    assert last["choices"][0]["stop_reason"] == 5
    text = responses.chunk("r", "m", False, 2, None, [4], None)
    assert text["choices"][0]["text"] == "" and "stop_reason" not in text["choices"][0]
    assert responses.usage_chunk("r", "m", False, responses.usage(1, 1))["choices"] == []
