"""Typed figures in the playbook's prose: numbers and number words next to a unit, outside `{{ result: }}`.

Every measured or predicted figure a chapter or a notebook's markdown states comes from the run (a `{{ result: }}`
placeholder in a chapter; in a notebook, a printed value). `typed_figures(text)` finds the ones typed in instead:
1. drop what is not prose: `{{ result: ... }}` and `{{ source: ... }}` placeholders, HTML tags, fenced code;
2. find a number (`120`, `3.1`, `~10`, `8k`, `1,024`) or a number word (`half`, `seven`, `twice`, `dozen`) next to a
   unit of UNITS: right after it (`84 GiB`, `7x`, `40%`, `34 s`), after a hyphen (`8k-token`), for the word units
   after one more word (`512 concurrent requests`), or `N times` (`seven times`);
3. drop the hits that match ALLOWED: a short, reviewed list of definitional constants (the workloads' lengths and
   concurrency, hardware specs from `data/hardware.json`, the unit of the per-component times), each with its reason.

`backend_mismatches(text)` finds the other way a quoted figure misleads: a placeholder whose key the notebook labels
with a backend (a key segment `cpu...` / `CPU...`: measured on this machine's CPU; `tpu...`: for the TPU, compiled
or predicted) in a paragraph that does not name that backend, so the reader is told a CPU measurement is a TPU
figure, or the reverse.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "playbook" / "chapters"
NOTEBOOKS = ROOT / "notebooks"

# The units a figure is typed in (the acceptance's list, with its binary and decimal siblings).
UNITS = ("GiB", "MiB", "KiB", "GB", "MB", "TB", "ms", "us", "µs", "s", "x", "%", "tokens", "token", "requests",
         "request", "TFLOP/s", "PFLOP/s", "GB/s", "TB/s")
WORD_UNITS = ("tokens", "token", "requests", "request")
NUMBER_WORDS = ("half", "twice", "double", "triple", "quarter", "dozen", "one", "two", "three", "four", "five", "six",
                "seven", "eight", "nine", "ten", "eleven", "twelve", "fifteen", "sixteen", "twenty", "thirty", "forty",
                "fifty", "sixty", "hundred", "thousand")

# (pattern over the hit, why it is a definition and not a measurement). Keep it short; every entry must be used.
ALLOWED: tuple[tuple[str, str], ...] = (
    (r"512 (concurrent |in-flight )?requests?", "the benchmark's concurrency: the workloads are defined at 512"),
    (r"(8k|1k|8192|1024) (input |output )?tokens?", "the workloads' input and output lengths (8k/1k, 1k/8k)"),
    (r"9,216 tokens", "a request's whole context in either workload: its input and output lengths added"),
    (r"(96|192) GiB", "TPU7x HBM per TensorCore / per chip: the hardware spec (data/hardware.json)"),
    (r"1,000 tokens", "the unit of the per-component times: milliseconds per 1,000 tokens served"),
    (r"(one|a single) (\w+ )?(token|request)", "one item: an article, not a figure"),
)

_NUMBER = r"(?<![\w.\-/])~?\d[\d,]*(?:\.\d+)?(?:[kKM](?![a-zA-Z]))?"
_WORD = r"\b(?:" + "|".join(NUMBER_WORDS) + r")\b"
_WORD_UNIT = "|".join(WORD_UNITS)
_SPACED = "|".join(re.escape(u) for u in sorted(set(UNITS) - {"x"}, key=len, reverse=True))
# `84 GiB`, `40%`, `7x` (not `8 x 96`: a product), `8k-token`; a unit not part of a longer word (`x86`, `GB/s`)
_AFTER = rf"(?:\s?(?:{_SPACED})|x|-(?:{_WORD_UNIT}))(?![\w/])"
_FIGURE = re.compile(
    rf"(?:{_NUMBER}|(?i:{_WORD}))(?:{_AFTER}|\s+[a-z][\w\-]*\s+(?:{_WORD_UNIT})\b|\s+times\b)")
_DROP = re.compile(r"\{\{\s*(?:result|source):.*?\}\}|<[^>\n]*>|^```.*?^```", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Figure:
    where: str  # file:line
    text: str  # the hit, e.g. "120 GiB"

    def __str__(self) -> str:
        return f"{self.where}: {self.text!r}"


def allowed(hit: str) -> str | None:
    """The ALLOWED pattern `hit` matches whole, or None."""
    return next((p for p, _ in ALLOWED if re.fullmatch(p, hit)), None)


def typed_figures(text: str, where: str = "") -> tuple[list[Figure], list[str]]:
    """(figures typed in `text` that no ALLOWED entry covers, the ALLOWED patterns used), line numbers kept."""
    blanked = _DROP.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets, same lines
    bad, used = [], []
    for m in _FIGURE.finditer(blanked):
        hit = re.sub(r"\s+", " ", m.group(0).lstrip("~"))
        pattern = allowed(hit)
        if pattern:
            used.append(pattern)
        else:
            bad.append(Figure(f"{where}:{blanked.count(chr(10), 0, m.start()) + 1}", hit))
    return bad, used


def notebook_markdown(path: pathlib.Path) -> str:
    """The markdown cells of a jupytext py:percent notebook, as one text whose lines are the .py file's lines (code
    lines blank), with the leading `# ` of each markdown line removed."""
    out, in_markdown = [], False
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            in_markdown = "[markdown]" in line
            out.append("")
        elif in_markdown:
            out.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        else:
            out.append("")
    return "\n".join(out)


def prose_files() -> list[pathlib.Path]:
    """Every chapter and every notebook source of the checkout."""
    return sorted(CHAPTERS.glob("*.md")) + sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def scan(path: pathlib.Path) -> tuple[list[Figure], list[str]]:
    """`typed_figures` of a chapter (.md) or of a notebook's markdown cells (.py)."""
    text = path.read_text() if path.suffix == ".md" else notebook_markdown(path)
    return typed_figures(text, str(path.resolve().relative_to(ROOT)))


BACKENDS = {"cpu": "CPU", "tpu": "TPU"}  # a key segment's prefix -> the word the paragraph must hold
_SEGMENT = re.compile(r"(?i)^(cpu|tpu)")


def key_backend(path: str) -> str | None:
    """The backend a result key is labelled with by its notebook (`01.naive_tp.cpu_kv_ratio`: "CPU"), or None."""
    for segment in re.split(r"[./]", path)[1:]:
        m = _SEGMENT.match(segment)
        if m:
            return BACKENDS[m.group(1).lower()]
    return None


def backend_mismatches(text: str, where: str = "") -> list[str]:
    """Placeholders of `text` whose key is labelled with a backend its paragraph (a block between blank lines)
    does not name, each as `where: key (labelled CPU) in a paragraph that does not say CPU`."""
    from playbook.results import PLACEHOLDER

    out = []
    for block in re.split(r"\n\s*\n", text):
        prose_only = PLACEHOLDER.sub(" ", block)
        for m in PLACEHOLDER.finditer(block):
            backend = key_backend(m.group(1))
            if backend and not re.search(rf"\b{backend}", prose_only):
                out.append(f"{where}: {m.group(1)} (labelled {backend}) in a paragraph that does not say {backend}")
    return out
