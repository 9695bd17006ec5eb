"""Results the notebooks recorded, and the `{{ result: ... }}` placeholders that quote them in the chapters.

A placeholder names one value: `{{ result: STEP.FILE.KEY... }}`, optionally `| FORMAT`.
  STEP    the notebook's number, `06` for `06_cost_model_and_benchmarks`
  FILE    the stem of a JSON file the notebook wrote under `$QWEN35_RESULTS_DIR` (`ladder` for ladder.json)
  KEY...  keys into that JSON document; list items by index (`budgets.0.fits`)
  FORMAT  `bytes` (binary units, `3.75 GiB`), `x` (a ratio, `3.10x`), or a Python format spec (`,`, `.2f`, `.1%`)

Filling a placeholder:
1. The step is not a chapter or notebook of this checkout: an error (a typo).
2. The step's notebook was not run in this build (absent, or left out with `--only`) or failed: the value is
   shown as missing, with the reason. A figure is never typed in.
3. The notebook ran and did not produce the value: an error, raised by `fill` after all placeholders are seen,
   naming each one and what the notebook did produce.

A claim placeholder, `{{ claim: STEP.NAME }}`, renders the sentence of a comparison the step's notebook checked
(`qwen35_lib.notebook.claim`, recorded in its `claims` results; playbook/claims.py), by the same rules; a recorded claim
that does not hold is an error.

A figure placeholder, `{{ figure: STEP.NAME }}`, shows the PNG that the step's notebook drew in the cell marked
`# figure: NAME` (playbook/run.py), linked to the executed notebook; it is filled by the same rules.
"""

from __future__ import annotations

import dataclasses
import html
import re
from typing import Any

from playbook.claims import CLAIM, CLAIMS_KEY, render, starts_sentence

PLACEHOLDER = re.compile(r"\{\{\s*result:\s*([\w.\-/]+)\s*(?:\|\s*([^}]*?)\s*)?\}\}")
FIGURE = re.compile(r"\{\{\s*figure:\s*(\w+)\.([\w\-]+)\s*\}\}")


class PlaceholderError(ValueError):
    """A chapter names a result that the run did not produce, or a step that does not exist."""


@dataclasses.dataclass
class Value:
    path: str
    text: str | None  # the formatted value; None when missing
    reason: str = ""  # why it is missing

    def html(self) -> str:
        if self.text is None:
            reason = html.escape(self.reason)
            return f'<span class="pb-missing" title="{reason}">missing ({reason})</span>'
        return f'<span class="pb-result" title="{html.escape(self.path)}">{html.escape(self.text)}</span>'


def flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": [1, 2]}}` -> `{"a.b.0": 1, "a.b.1": 2}`: every scalar with the path a placeholder uses."""
    if isinstance(doc, dict):
        items = doc.items()
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return {prefix: doc}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def format_value(value: Any, spec: str | None) -> str:
    if isinstance(value, (dict, list)) or value is None:
        raise TypeError(f"not a single number or string: {value!r}")
    if spec == "bytes":
        size = float(value)
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(size) < 1024 or unit == "TiB":
                return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
            size /= 1024
    if spec == "x":
        return f"{float(value):.2f}x"
    if spec:
        return format(value, spec)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


class Results:
    """The notebooks of one build (entries of results.json) and the steps the playbook knows."""

    def __init__(self, entries: list[dict[str, Any]], steps: set[str], facts: dict[str, dict] | None = None):
        """`facts`: documents quoted as the results of a step of that name that no notebook runs (the primer's
        hardware, `playbook.facts`), always present."""
        self.by_step = {e["name"][:2]: e for e in entries}
        for step, docs in (facts or {}).items():
            self.by_step[step] = dict(name=step, status="ok", results=docs)
        self.steps = steps | set(self.by_step)

    def lookup(self, path: str, spec: str | None = None) -> Value:
        step, _, rest = path.partition(".")
        if step not in self.steps:
            raise PlaceholderError(f"{path}: no step {step!r} (steps: {', '.join(sorted(self.steps))})")
        entry = self.by_step.get(step)
        if entry is None:
            return Value(path, None, f"notebook {step} did not run in this build")
        produced = flatten(entry.get("results") or {})
        if rest in produced:
            try:
                return Value(path, format_value(produced[rest], spec))
            except (TypeError, ValueError) as e:
                raise PlaceholderError(f"{path}: cannot format as {spec!r}: {e}") from None
        if entry["status"] != "ok":
            return Value(path, None, f"notebook {entry['name']} failed")
        known = ", ".join(f"{step}.{k}" for k in sorted(produced)[:40]) or "nothing"
        raise PlaceholderError(f"{path}: notebook {entry['name']} ran but did not produce it; it produced: {known}")

    def figure(self, step: str, name: str) -> str:
        """The HTML of figure `name` of `step`'s notebook: the image linked to the executed notebook, or why it is
        missing; PlaceholderError for an unknown step, or a notebook that ran without drawing it."""
        if step not in self.steps:
            raise PlaceholderError(f"figure {step}.{name}: no step {step!r} (steps: {', '.join(sorted(self.steps))})")
        entry = self.by_step.get(step)
        figures = (entry or {}).get("figures") or {}
        if name in figures:
            alt = html.escape(f"figure {name} of notebook {entry['name']}, drawn in this build")
            return (f'<a class="pb-figure" href="{html.escape(entry["html"])}"><img src="{html.escape(figures[name])}" '
                    f'alt="{alt}" title="{alt}"></a>')
        if (missing := self._missing(step, f"figure {name}")) is not None:
            return missing
        raise PlaceholderError(f"figure {step}.{name}: notebook {entry['name']} ran but drew no cell marked "
                               f"'# figure: {name}'; its figures: {', '.join(sorted(figures)) or 'none'}")

    def _missing(self, step: str, what: str) -> str | None:
        """The HTML saying `what` (e.g. "figure mesh") is missing because `step`'s notebook did not run in this
        build or failed; None when it ran."""
        entry = self.by_step.get(step)
        if entry is not None and entry["status"] == "ok":
            return None
        reason = f"notebook {step} did not run in this build" if entry is None else f"notebook {entry['name']} failed"
        return f'<span class="pb-missing" title="{html.escape(reason)}">{what} missing ({reason})</span>'

    def claim(self, step: str, name: str, capital: bool = False) -> str:
        """The HTML of claim `name` of `step`'s notebook (`playbook.claims.render`), or why it is missing;
        PlaceholderError for an unknown step, a notebook that ran without recording it, or a claim that does not
        hold."""
        if step not in self.steps:
            raise PlaceholderError(f"claim {step}.{name}: no step {step!r} (steps: {', '.join(sorted(self.steps))})")
        entry = self.by_step.get(step)
        recorded = ((entry or {}).get("results") or {}).get(CLAIMS_KEY) or {}
        if name in recorded:
            if not recorded[name].get("holds"):
                raise PlaceholderError(f"claim {step}.{name} does not hold in this run: {recorded[name].get('text')}")
            return render(step, name, recorded[name], capital)
        if (missing := self._missing(step, f"claim {name}")) is not None:
            return missing
        raise PlaceholderError(f"claim {step}.{name}: notebook {entry['name']} ran but checked no such claim; its "
                               f"claims: {', '.join(sorted(recorded)) or 'none'}")

    def fill(self, text: str, where: str) -> tuple[str, list[Value]]:
        """Replace each placeholder in `text` with its value's HTML; raise PlaceholderError listing every bad one."""
        values: list[Value] = []
        errors: list[str] = []

        def replace(match: re.Match) -> str:
            try:
                value = self.lookup(match.group(1), match.group(2) or None)
            except PlaceholderError as e:
                errors.append(f"{where}: {e}")
                return match.group(0)
            values.append(value)
            return value.html()

        def replace_figure(match: re.Match) -> str:
            try:
                return self.figure(match.group(1), match.group(2))
            except PlaceholderError as e:
                errors.append(f"{where}: {e}")
                return match.group(0)

        def replace_claim(match: re.Match) -> str:
            try:
                return self.claim(match.group(1), match.group(2), starts_sentence(match.string, match.start()))
            except PlaceholderError as e:
                errors.append(f"{where}: {e}")
                return match.group(0)

        filled = CLAIM.sub(replace_claim, FIGURE.sub(replace_figure, PLACEHOLDER.sub(replace, text)))
        if errors:
            raise PlaceholderError("\n".join(errors))
        return filled, values
