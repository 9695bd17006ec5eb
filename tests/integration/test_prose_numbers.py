"""No measured or predicted figure is typed into the prose: chapters and notebook markdown quote them from the run
(`{{ result: }}` in a chapter, a printed value in a notebook). `playbook.prose` finds numbers and number words next to
a unit outside the placeholders; a short reviewed allowlist (`prose.ALLOWED`) keeps definitional constants.

Covered now: every chapter (00-09, the introduction, the conclusion) and notebook (00-09). NOT_YET_COVERED lists,
explicitly, what is not (nothing now): a new chapter or notebook must be added to one of the two."""

from __future__ import annotations

import itertools
import pathlib
import re

import pytest

from playbook import prose
from playbook.results import PLACEHOLDER

ROOT = prose.ROOT
COVERED_STEPS = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "introduction", "primer", "conclusion")
NOT_YET_COVERED: tuple[str, ...] = ()  # every chapter and notebook is covered
# the stage(s) each chapter's headline gain names (its step of the ladder)
STAGE_OF = {"01": ("baseline",), "02": ("dp_ep",), "03": ("replicate",), "04": ("fused_ag", "hier_rs"),
            "05": ("kernels",)}


def _key(path: pathlib.Path) -> str:
    return path.stem if not path.stem[:2].isdigit() else path.stem[:2]


COVERED = [p for p in prose.prose_files() if _key(p) in COVERED_STEPS]


def test_every_prose_file_is_covered_or_listed_as_not_yet() -> None:
    unclassified = [p.name for p in prose.prose_files() if _key(p) not in COVERED_STEPS + NOT_YET_COVERED]
    assert not unclassified, (f"classify {unclassified} in tests/integration/test_prose_numbers.py: COVERED_STEPS or "
                              "NOT_YET_COVERED")
    assert len(COVERED) == 23, [p.name for p in COVERED]  # chapters 00-09, introduction, primer, conclusion; notebooks


@pytest.mark.parametrize("path", COVERED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_typed_figures(path: pathlib.Path) -> None:
    bad, _ = prose.scan(path)
    assert not bad, ("figures typed into prose (quote them with {{ result: NN.file.key }} in a chapter, print them in "
                     "a notebook, or, for a definition, add a reviewed entry to playbook.prose.ALLOWED):\n"
                     + "\n".join(map(str, bad)))


def test_every_allowlist_entry_is_used() -> None:
    used = {u for p in COVERED for u in prose.scan(p)[1]}
    unused = [pattern for pattern, _ in prose.ALLOWED if pattern not in used]
    assert not unused, f"playbook.prose.ALLOWED entries no covered prose uses: {unused}; remove them"


def test_a_covered_chapter_with_a_typed_figure_fails(tmp_path: pathlib.Path) -> None:
    chapter = next((ROOT / "playbook" / "chapters").glob("02_*.md"))
    typed = tmp_path / chapter.name
    typed.write_text(chapter.read_text() + "\nThe step is 1.9x faster.\n")
    bad, _ = prose.typed_figures(typed.read_text(), typed.name)
    assert [f.text for f in bad] == ["1.9x"]
    assert bad[0].where == f"{typed.name}:{typed.read_text().count(chr(10))}"


def _chapter(step: str) -> pathlib.Path:
    return next((ROOT / "playbook" / "chapters").glob(f"{step}_*.md"))


def _notebook(step: str) -> pathlib.Path:
    return next(prose.NOTEBOOKS.glob(f"{step}_*.py"))


@pytest.mark.parametrize("step", sorted(STAGE_OF))
def test_each_chapter_opens_with_its_stage_from_its_own_notebook(step: str) -> None:
    """Chapters 01-05: the box after the title (its quoted paragraphs and tables) quotes, from its own notebook's
    record, each of its stages for both workloads under `stages.<stage>.<workload>` (the headline: `gain`, or the
    baseline's throughput); every placeholder of the chapter names a file its notebook writes and a key it records."""
    text = _chapter(step).read_text()
    blocks = text.split("\n\n")[1:]  # after the title
    assert blocks[0].startswith("> **What th"), f"chapter {step} must open with what its step buys"
    opening = "\n\n".join(itertools.takewhile(lambda b: b.startswith((">", "|")), blocks))  # quotes and tables
    paths = [m.group(1) for m in PLACEHOLDER.finditer(opening)]
    for stage in STAGE_OF[step]:
        for workload in ("8k/1k", "1k/8k"):
            quoted = [p for p in paths if re.fullmatch(rf"{step}\.\w+\.stages\.{stage}\.{workload}\..+", p)]
            headline = "total_tokens_per_s" if stage == "baseline" else "gain"
            assert any(p.endswith(f".{headline}") for p in quoted), \
                f"chapter {step} does not open with stages.{stage}.{workload}.{headline}"
    source = _notebook(step).read_text()
    files = set(re.findall(r'save_results\("(\w+)"', source))
    for path in (m.group(1) for m in PLACEHOLDER.finditer(text) if m.group(1).startswith(f"{step}.")):
        stem, first = path.split(".")[1:3]
        assert stem in files, f"{path}: notebook {step} writes {sorted(files)}, not {stem!r}"
        assert re.search(rf"\b{re.escape(first)}\s*=|[\"']{re.escape(first)}[\"']", source), \
            f"{path}: notebook {step} records no {first!r}"


# -- what the reader sees: no markup shown as text, no figure under another backend's name, no second-hand claim
# without its provenance (issue 31) --

def _rendered_chapters() -> list[tuple[str, str]]:
    """(file, HTML) of every chapter as the builder renders it, every quoted result missing (no notebook ran): the
    placeholders still become HTML, so one inside a code span shows its markup as text."""
    from playbook import facts, site
    from playbook.results import Results

    pages = [p for p in site.reading_order(site.chapter_paths(), []) if p.source is not None]
    steps = {p.step for p in pages if p.step} | {p.stem[:2] for p in prose.NOTEBOOKS.glob("[0-9][0-9]_*.py")}
    results = Results([], steps | {site.BUILD_STEP}, facts={facts.STEP: facts.documents()})
    out = []
    for page in pages:
        body, _, error = site.chapter_body(page, results, [], {})
        assert error is None, error
        out.append((page.source.name, body))
    return out


def test_no_rendered_chapter_shows_html_as_text() -> None:
    from playbook import site

    shown = {name: site.raw_markup(body) for name, body in _rendered_chapters()}
    shown = {k: v[:3] for k, v in shown.items() if v}
    assert not shown, f"markup rendered as text (move the placeholder out of the `code` span): {shown}"


@pytest.mark.parametrize("path", sorted(prose.CHAPTERS.glob("*.md")), ids=lambda p: p.name)
def test_a_quoted_figure_is_said_to_be_from_its_backend(path: pathlib.Path) -> None:
    bad = prose.backend_mismatches(path.read_text(), path.name)
    assert not bad, "a figure its notebook labels with a backend, quoted without naming it:\n" + "\n".join(bad)


def test_the_reported_gains_are_quoted_with_their_provenance() -> None:
    """The 3.1x / 4.7x of `data/published.json`'s `reported_ladder` come from an account whose post was not found and
    whose workload mapping is inferred: every paragraph that quotes them says so."""
    for path in sorted(prose.CHAPTERS.glob("*.md")):
        for block in re.split(r"\n\s*\n", path.read_text()):
            if re.search(r"\{\{\s*result:\s*06\.costmodel\.reported\.", block):
                assert "not found" in " ".join(block.split()), \
                    f"{path.name}: quotes the reported gains without their provenance:\n{block}"
        bare = re.findall(r"(?<![\d.])(?:3\.1|4\.7)x", path.read_text())
        assert not bare, f"{path.name}: the reported gains typed in: {bare}"


def test_every_placeholder_in_a_chapter_is_well_formed() -> None:
    """A `{{` that starts no result, figure or source placeholder (one broken over a quoted line, a typo) would be
    printed as it stands."""
    from playbook.claims import CLAIM
    from playbook.results import FIGURE
    from playbook.site import SOURCE

    for path in sorted(prose.CHAPTERS.glob("*.md")):
        text = path.read_text()
        starts = {m.start() for pattern in (PLACEHOLDER, FIGURE, SOURCE, CLAIM) for m in pattern.finditer(text)}
        broken = [text[i:i + 40] for i in (m.start() for m in re.finditer(r"\{\{", text)) if i not in starts]
        assert not broken, f"{path.name}: placeholders that do not parse: {broken}"


def test_the_conclusion_shows_the_two_by_two_from_the_run() -> None:
    """Issue 31: the conclusion quotes every corner of notebook 06's attribution (both workloads) and each effect."""
    from qwen35_lib.costmodel.attribution import CORNERS, WORKLOADS

    text = (prose.CHAPTERS / "conclusion.md").read_text()
    quoted = {m.group(1) for m in PLACEHOLDER.finditer(text)}
    for wl in WORKLOADS:
        for stage in CORNERS.values():
            assert f"06.costmodel.attribution.corners.{stage}.{wl}.total_tokens_per_s" in quoted, (stage, wl)
        for effect in ("kernels_under_tp", "kernels_under_dp_ep", "layout_with_xla", "layout_with_pallas"):
            assert f"06.costmodel.attribution.{wl}.{effect}" in quoted, (effect, wl)
        assert f"06.costmodel.attribution.collectives.{wl}.total" in quoted
    assert re.search(r"attribution=att\b", _notebook("06").read_text()), "notebook 06 records no attribution"
