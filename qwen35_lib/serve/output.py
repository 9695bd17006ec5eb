"""One choice's output as it streams: incremental text, stop strings, and what to send next.

1. each token goes through the incremental detokenizer (with or without special tokens) and its text is added
   to the choice's text;
2. with stop strings, only the text that could hold a match not seen before is searched: for each stop string s,
   from `len(s) - 1` characters before the text the last search saw (vLLM's window), so a token costs
   O(stop strings + their characters), never the whole text again; the earliest match ends the choice: the text
   is cut before the stop string (or after it, with `include_stop_str_in_output`) and `stopped` names it;
3. the token that ends the choice as a stop token (EOS, `stop_token_ids`) adds no text unless
   `include_stop_str_in_output`, as vLLM's detokenizer (special or not);
4. what is sent is the text up to the last `longest stop string - 1` characters (those could still begin a
   match), all of it once the choice ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ChoiceOutput:
    def __init__(self, text: Any, stop: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.detok = text.detokenizer(skip_special_tokens) if text is not None else None
        self.stop, self.include_stop = tuple(stop), include_stop
        self.hold = max(map(len, self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the choice's text so far (cut at a stop string once one is seen)
        self.sent = 0  # characters of `text` already sent
        self.stopped: str | None = None  # the stop string that ended the choice
        self.scanned = 0  # characters of `text` the last stop-string search saw

    def push(self, token: int, stops: bool = False) -> str:
        """Add a token; returns the text now safe to send. A token that `stops` the choice (EOS or a stop id) is
        kept in `ids` but not in the text unless `include_stop` (vLLM's detokenizer)."""
        self.ids.append(int(token))
        if self.detok is None or (stops and not self.include_stop):
            return ""
        self.text += self.detok.push(token)
        return self._emit(final=False)

    def finish(self) -> str:
        """The engine finished the choice: the rest of the text."""
        if self.detok is not None and self.stopped is None:
            self.text += self.detok.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stop and self.stopped is None:
            seen, self.scanned = self.scanned, len(self.text)
            found = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, seen - len(s) + 1))) >= 0]
            if found:
                i, s = min(found)
                self.stopped = s
                self.text = self.text[:i + len(s) if self.include_stop else i]
                final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent:end], end
        return piece
