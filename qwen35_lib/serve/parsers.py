"""What a chat answer says besides its content: Qwen3's reasoning (`<think>...</think>`) and tool calls
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the Hermes format Qwen's templates write), split as
vLLM's `--reasoning-parser qwen3` and `--tool-call-parser hermes` split them.

Reasoning, whole answer (`split_reasoning`): without `</think>` the whole text is content; with it, the text before
(less a leading `<think>`) is the reasoning and the text after is the content (None when empty).
Reasoning, streamed (`ReasoningStream`): as vLLM streams it, text before `</think>` is reasoning (the template may
have opened the block in the prompt), text after is content; a possible start of `<think>` or `</think>` at the end
of the text so far is held back until the next piece shows what it is.
Tool calls (`split_tool_calls`): every `<tool_call>` block whose body is a JSON object with a string `name` becomes
a call (`arguments` as a JSON string); the content is the text before the first block (None when empty). Text that
does not parse stays content, as vLLM leaves it.
Tool calls, streamed (`ToolCallStream`): the content before the first `<tool_call>` streams as content (a possible
start of the tag at the end held back), each block is sent as one call once `</tool_call>` closes it; with no call
at the end, the held text goes out as content: the same content and calls as the whole answer's split.
Forced tool calls, streamed (`ForcedToolStream`: tool_choice a named function or "required", whose answer is
constrained to the calls' JSON): a named function's arguments stream as they come (the first delta with the call's
id, type and name); "required" sends each call of the JSON array once its object is complete (name and arguments),
found by one pass over the text (depth and string state kept between pieces).
"""

from __future__ import annotations

import json
import re
import uuid

THINK, END_THINK = "<think>", "</think>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer."""
    if END_THINK not in text:
        return None, text
    before, sep, after = text.partition(THINK)
    reasoning, _, content = (after if sep else before).partition(END_THINK)
    return reasoning, content or None


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """`push(piece, final)` -> (reasoning delta, content delta) of a streamed answer."""

    def __init__(self):
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def push(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece or ""
        t = self.text
        if not final and THINK.startswith(t):  # the answer may still open with <think>
            return "", ""
        if t.startswith(THINK):
            t = t[len(THINK):]
        if END_THINK in t:
            reasoning, _, content = t.partition(END_THINK)
        else:
            reasoning, content = t[:len(t) - (0 if final else _held(t, END_THINK))], ""
        r, c = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return r, c


def tool_call(name: str, arguments) -> dict:
    """One tool call in the OpenAI shape (`arguments` as a JSON string)."""
    return dict(id=f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", type="function",
                function=dict(name=name, arguments=arguments if isinstance(arguments, str) else
                              json.dumps(arguments, ensure_ascii=False)))


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls in the OpenAI shape) of a whole answer."""
    calls = []
    for m in TOOL_CALL.finditer(text):
        try:
            doc = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            continue
        calls.append(tool_call(doc["name"], doc.get("arguments", doc.get("parameters", {}))))
    if not calls:
        return text, []
    content = text[:text.index("<tool_call>")]
    return content if content.strip() else None, calls


class ToolCallStream:
    """`push(piece, final)` -> (content delta, tool-call deltas) of a streamed answer with Hermes tool calls."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.text, self.sent, self.first, self.pos, self.calls = "", 0, None, 0, 0
        self.scanned, self.open = 0, None  # text searched so far; where the block being read opens

    def push(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += piece or ""
        t, calls = self.text, []
        if self.first is None:
            i = t.find(self.OPEN, self.sent)
            if i < 0:  # all content so far, less a possible start of the tag
                end = len(t) if final else len(t) - _held(t, self.OPEN)
                piece, self.sent = t[self.sent:end], max(self.sent, end)
                return piece, []
            self.first = self.pos = i
        content, self.sent = t[self.sent:self.first], self.first
        while True:  # each character searched once for the tag it may hold next
            if self.open is None:
                i = t.find(self.OPEN, max(self.pos, self.scanned - len(self.OPEN) + 1))
                if i < 0:
                    self.scanned = len(t)
                    break
                self.open, self.scanned = i, i + len(self.OPEN)
            j = t.find(self.CLOSE, max(self.open, self.scanned - len(self.CLOSE) + 1))
            if j < 0:
                self.scanned = len(t)
                break
            self.pos = self.scanned = j + len(self.CLOSE)
            _, found = split_tool_calls(t[self.open:self.pos])
            self.open = None
            calls += [dict(index=self.calls + k, **c) for k, c in enumerate(found)]
            self.calls += len(found)
        if final and not self.calls:  # no block parsed: the whole answer is content, as unstreamed
            content, self.sent = content + t[self.sent:], len(t)
        return content, calls


class ForcedToolStream:
    """`push(piece)` -> the tool-call deltas (OpenAI's streamed `delta.tool_calls` items) of an answer constrained
    by a forced tool choice: `forced` is a function's name or "required". `calls` counts the calls begun."""

    def __init__(self, forced: str):
        self.forced, self.calls = forced, 0
        self.text, self.pos, self.depth, self.in_str, self.esc, self.start = "", 0, 0, False, False, 0

    def push(self, piece: str) -> list[dict]:
        if not piece:
            return []
        if self.forced != "required":  # the whole answer is the function's arguments
            if self.calls:
                return [dict(index=0, function=dict(arguments=piece))]
            self.calls = 1
            return [dict(index=0, **tool_call(self.forced, piece))]
        self.text += piece
        out = []
        for i in range(self.pos, len(self.text)):  # each character once over the whole answer
            ch = self.text[i]
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "[{":
                self.depth += 1
                self.start = i if self.depth == 2 else self.start
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":
                    out += self._call(self.text[self.start:i + 1])
        self.pos = len(self.text)
        return out

    def _call(self, obj: str) -> list[dict]:
        try:
            doc = json.loads(obj)
        except ValueError:
            return []
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            return []
        self.calls += 1
        return [dict(index=self.calls - 1, **tool_call(doc["name"], doc.get("parameters", {})))]
