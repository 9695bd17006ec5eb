"""`serve.choices`: a chat answer's message (reasoning, tool calls) and a request's choices once they are done; their
running, gathering and streaming through a live server are tested in test_app.py and test_loop.py."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("fastapi")

from qwen35_lib.serve import choices  # noqa: E402
from qwen35_lib.serve.output import ChoiceOutput  # noqa: E402
from qwen35_lib.serve.request import Parsed  # noqa: E402


def test_chat_message_splits_the_reasoning_and_the_tool_calls():
    parsed = Parsed([[1]], [None], False, False, True, reasoning=True, tools=True)
    answer = 'hm</think>ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    content, extra = choices.chat_message(parsed, answer)
    assert content.strip() == "ok" and extra["reasoning"] == extra["reasoning_content"] == "hm"
    assert [c["function"]["name"] for c in extra["tool_calls"]] == ["f"]
    hidden = Parsed([[1]], [None], False, False, True, reasoning=True, include_reasoning=False)
    assert choices.chat_message(hidden, "hm</think>ok") == ("ok", {})
    assert choices.chat_message(Parsed([[1]], [None], False, False, True), "plain") == ("plain", {})


def test_a_finished_choice():
    """A choice with nothing to generate (echo, max_tokens 0) is done from the start: its text is the prompt."""
    parsed = Parsed([[1, 2]], [None], False, False, False, echo=True)
    run = types.SimpleNamespace(parsed=parsed, outs=[ChoiceOutput(None)],
                                finish={0: ("length", None)}, prompt_text=lambda i: "ab")
    c = choices.choice(run, 0, None, None)
    assert (c["text"], c["token_ids"], c["finish_reason"], c["logprobs"]) == ("ab", [], "length", None)
