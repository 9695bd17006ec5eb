"""Comparisons in the chapters as claims the run checked (DESIGN principle 7).

A notebook checks each comparison its chapter states with `qwen35_lib.notebook.claim` (or `claim_greater`,
`claim_largest`, `claim_within`): the run fails when one does not hold, and the records land in its results as
`claims` (`<results>/claims.json`). A chapter then states the comparison as `{{ claim: STEP.NAME }}`: the claim's own
sentence, its numbers from the run, marked as checked and linked to the record on the results page.

    {{ claim: 01.moe_largest_8k1k }}

Filling a claim placeholder follows `playbook.results`' rules: an unknown step is an error; a notebook that did not
run (or failed) shows it missing; a notebook that ran without recording it is an error naming the claims it has; a
recorded claim that does not hold is an error (the notebook raised, so the build fails anyway).

`unbacked_comparisons(text)` is the other half: a sentence of a chapter's boxes (its `>` blocks: the opening box,
the takeaways, the notes) that compares (COMPARISON: "more than", "largest", "dominates", "gains more", ...) without
a `{{ claim: }}` is reported, and the build fails, unless a reviewed ALLOWED entry covers it (a comparison that is a
definition or a design fact, not a number of the run), each with its reason.
"""

from __future__ import annotations

import html
import re
import string
from typing import Any

CLAIM = re.compile(r"\{\{\s*claim:\s*(\w+)\.([\w\-]+)\s*\}\}")
CLAIMS_KEY = "claims"  # the results file a notebook's claims are in (`qwen35_lib.notebook.CLAIMS_FILE`)

# Words that compare two quantities, or one with a range or the rest (checked case-insensitively, whole words).
COMPARISON = re.compile(
    r"(?i)\b(?:more|less|fewer|larger|largest|smaller|smallest|greater|greatest|higher|highest|lower|lowest|faster|"
    r"slower|bigger|biggest|cheaper|costlier|dominat\w*|exceed\w*|outweigh\w*|most|least|beats?|twice|"
    r"as much as|better|worse|within|below|above|recovers?|wins?|free)\b")

# (pattern searched in the sentence, why it states no comparison of the run's numbers). Keep it short; every entry
# must be used by some chapter (tests/playbook/test_claims.py).
ALLOWED: tuple[tuple[str, str], ...] = ()

_PLACEHOLDERS = re.compile(r"\{\{.*?\}\}", re.S)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*(`\[])")


def fields(statement: str) -> list[tuple[str, str, str]]:
    """(literal text, field name, format spec) of a claim's statement, as `str.format` reads it."""
    return [(lit, name or "", spec or "") for lit, name, spec, _ in string.Formatter().parse(statement)]


def starts_sentence(text: str, pos: int) -> bool:
    """Whether a placeholder at `pos` of `text` opens a sentence: nothing but blockquote marks and spaces before it
    in its paragraph, or a sentence's end (`.`, `!`, `?`, a bold run's end after one) just before it."""
    before = re.sub(r"[\s>]+$", "", text[:pos])
    return not before or before.endswith(("\n\n", ".", "!", "?", ".**", ":**")) or "\n\n" in text[len(before):pos]


def render(step: str, name: str, record: dict[str, Any], capital: bool = False) -> str:
    """A claim's sentence as HTML: each number from the run in a result span, the whole marked as checked and
    linked to its record on the results page; `capital`: its first letter upper case (it opens a sentence)."""
    parts = []
    statement = record["statement"]
    if capital and statement[:1].islower():
        statement = statement[0].upper() + statement[1:]
    for literal, field, spec in fields(statement):
        parts.append(html.escape(literal))
        if field:
            value = format(record["values"][field], spec)
            parts.append(f'<span class="pb-result" title="{step}.claims.{html.escape(name)}.values.'
                         f'{html.escape(field)}">{html.escape(value)}</span>')
    title = html.escape(f"checked by notebook {step}'s run: {record.get('relation') or 'holds'}")
    return (f'<span class="pb-claim" title="{title}">{"".join(parts)}<a class="pb-check" '
            f'href="results.html#claim-{step}-{html.escape(name)}" title="{title}">&#10003;</a></span>')


def box_sentences(text: str) -> list[tuple[int, str]]:
    """(line, sentence) of every sentence in the `>` blocks of a chapter, placeholders kept."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith(">"):
            i += 1
            continue
        start, block = i, []
        while i < len(lines) and lines[i].startswith(">"):
            block.append(lines[i][1:].strip())
            i += 1
        joined = " ".join(block)
        # split on sentence ends outside placeholders: blank each placeholder's inside to the same length
        blanked = _PLACEHOLDERS.sub(lambda m: "{{" + "_" * (len(m.group(0)) - 4) + "}}", joined)
        pos = 0
        for m in _SENTENCE_END.finditer(blanked):
            out.append((start + 1, joined[pos:m.start()].strip()))
            pos = m.end()
        if joined[pos:].strip():
            out.append((start + 1, joined[pos:].strip()))
    return out


def unbacked_comparisons(text: str, where: str = "") -> tuple[list[str], list[str]]:
    """(sentences of the boxes that compare with no `{{ claim: }}` and no ALLOWED entry, each as
    `where:line: "word" in: sentence`; the ALLOWED patterns used)."""
    bad, used = [], []
    for line, sentence in box_sentences(text):
        if CLAIM.search(sentence):
            continue
        prose = _PLACEHOLDERS.sub(" ", sentence)
        word = COMPARISON.search(prose)
        if word is None:
            continue
        allowed = next((p for p, _ in ALLOWED if re.search(p, prose)), None)
        if allowed:
            used.append(allowed)
            continue
        bad.append(f"{where}:{line}: {word.group(0)!r} in: {' '.join(sentence.split())}")
    return bad, used


__all__ = ["ALLOWED", "CLAIM", "CLAIMS_KEY", "COMPARISON", "box_sentences", "fields", "render", "starts_sentence",
           "unbacked_comparisons"]
