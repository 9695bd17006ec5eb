"""ChoiceOutput: the streamed pieces add up to the choice's text, which ends before the earliest stop string (or
after it, with include_stop); until the end, the last `longest stop string - 1` characters are held back."""

from __future__ import annotations

import random

import pytest

from qwen35_lib.serve.output import ChoiceOutput

PIECES = {0: "a", 1: "b", 2: "c", 3: "ab", 4: "ca", 5: "xyz", 6: "abc"}


class FakeText:
    """A detokenizer whose token i is PIECES[i], and whose flush adds `tail` (what a real one holds back)."""

    def __init__(self, tail=""):
        self.tail, self.skip = tail, None

    def detokenizer(self, skip_special_tokens):
        self.skip = skip_special_tokens
        text = self

        class Detok:
            def push(self, token):
                return PIECES[token]

            def flush(self):
                return text.tail

        return Detok()


def _stream(tokens, **kw):
    out = ChoiceOutput(FakeText(kw.pop("tail", "")), **kw)
    pieces = [out.push(t) for t in tokens]
    return out, pieces, out.finish()


def test_without_stop_strings_every_piece_goes_at_once():
    out, pieces, last = _stream([5, 0, 2], tail="!")
    assert pieces == ["xyz", "a", "c"] and last == "!"
    assert out.text == "xyzac!" and out.ids == [5, 0, 2] and out.stopped is None


def test_the_last_characters_are_held_until_the_end():
    out, pieces, last = _stream([5, 0, 2, 0], stop=["ab"])  # longest stop 2: the last 1 character held
    assert pieces == ["xy", "z", "a", "c"] and last == "a" and out.stopped is None and out.text == "xyzaca"
    out, pieces, last = _stream([5, 0], stop=["q", "bca"])  # longest 3: 2 held
    assert pieces == ["x", "y"] and last == "za"


def test_stop_string_across_tokens_cuts_the_text_before_it_or_after_it():
    out, pieces, last = _stream([2, 0, 1], stop=["ab"], tail="!")  # the server stops pushing once `stopped`
    assert "".join(pieces) + last == "c" == out.text and out.stopped == "ab"  # no flush after a stop
    out, pieces, last = _stream([2, 0, 1], stop=["ab"], include_stop=True)
    assert "".join(pieces) + last == "cab" == out.text


def test_the_earliest_of_several_stop_strings_wins():
    out, pieces, last = _stream([2, 6], stop=["bc", "ab"])  # "cabc" in one push: "ab" at 1 before "bc" at 2
    assert out.stopped == "ab" and out.text == "c" and "".join(pieces) + last == "c"


@pytest.mark.parametrize("seed", range(20))
def test_random_streams_send_exactly_the_text_up_to_the_first_stop(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(7) for _ in range(rng.randrange(1, 12))]
    stop = rng.sample(["ab", "ca", "bca", "zab", "q"], rng.randrange(0, 3))
    include = rng.random() < 0.5
    out = ChoiceOutput(FakeText(), stop=stop, include_stop=include)
    hold = max(map(len, stop), default=1) - 1
    pieces = []
    for t in tokens:
        if out.stopped is not None:  # as the server does: the choice is done
            break
        pieces.append(out.push(t))
        if out.stopped is None:  # everything but the last `hold` characters seen so far is out
            assert out.sent == max(0, len(out.text) - hold) and "".join(pieces) == out.text[:out.sent]
    last = out.finish()
    full = "".join(PIECES[t] for t in tokens)
    hits = sorted((full.find(s), s) for s in stop if s in full)
    want = full if not hits else full[:hits[0][0] + (len(hits[0][1]) if include else 0)]
    assert "".join(pieces) + last == out.text == want
    assert out.stopped == (hits[0][1] if hits else None)


def test_no_text_records_ids_and_sends_nothing():
    out = ChoiceOutput(None, stop=["a"])
    assert out.push(3) == "" and out.finish() == "" and out.ids == [3]


def test_skip_special_tokens_reaches_the_detokenizer():
    text = FakeText()
    ChoiceOutput(text, skip_special_tokens=False)
    assert text.skip is False


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_token_adds_its_id_and_its_text_only_with_include_stop(include_stop):
    """vLLM's detokenizer: the token that ends a choice (EOS, a stop id) is not decoded unless
    include_stop_str_in_output."""
    out = ChoiceOutput(FakeText(), include_stop=include_stop)
    pieces = [out.push(5), out.push(6, stops=True)]
    assert pieces == ["xyz", "abc" if include_stop else ""] and out.ids == [5, 6]
    assert out.finish() == "" and out.text == ("xyzabc" if include_stop else "xyz")
