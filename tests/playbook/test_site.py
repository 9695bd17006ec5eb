"""The playbook builder's pieces: placeholders, navigation, and a whole site from a 2-cell fake notebook."""

from __future__ import annotations

import pathlib
import re

import pytest

from playbook import run, site
from tests.playbook.support import entry


def test_reading_order_and_navigation(tmp_path: pathlib.Path):
    for name in ("introduction", "primer", "00_demo", "01_next", "conclusion"):
        tmp_path.joinpath(f"{name}.md").write_text(f"# {name}\n")
    chapters = [tmp_path / f"{n}.md" for n in ("conclusion", "primer", "introduction", "00_demo", "01_next")]
    pages = site.reading_order(chapters, [entry("00_demo"), entry("02_extra")])
    assert [p.file for p in pages] == ["introduction.html", "primer.html", "00_demo.html", "notebook-00_demo.html",
                                       "01_next.html", "notebook-02_extra.html", "conclusion.html", "results.html"]
    pages = [p for p in pages if p.file != "primer.html"]
    links = re.findall(r'href="([^"]+)"', site.nav(pages, 1))
    assert links == ["introduction.html", "index.html", "notebook-00_demo.html"]
    assert re.findall(r'href="([^"]+)"', site.nav(pages, 0)) == ["index.html", "00_demo.html"]


def test_site_refuses_a_result_that_was_not_produced(checkout: pathlib.Path):
    checkout.joinpath("chapters", "conclusion.md").write_text("# End\n\n{{ result: 00.demo.typo }}\n")
    out = checkout / "site"
    out.mkdir()
    out.joinpath("notebook-00_demo.html").write_text("<html><head></head><body></body></html>")
    ran = dict(entry("00_demo", results={"demo": {"answer": 42}}), figures={"dot": "figures/00_demo-dot.png"})
    _, errors = site.write_site(out, [ran], site.build_info("3", "0", "cpu"), ["00_demo"])
    assert len(errors) == 1 and "conclusion.md: 00.demo.typo" in errors[0] and "00.demo.answer" in errors[0]
    assert "00.demo.typo" in out.joinpath("conclusion.html").read_text()


def test_the_build_facts_are_what_the_builder_measured():
    runs = [entry("00_demo"), dict(entry("01_later", status="failed"), seconds=3.5)]
    doc = site.build_facts(runs, site.build_info("3", "0", "x86_64, 2 CPUs"))[site.BUILD_STEP]["run"]
    assert doc["slowest"] == "01_later" and doc["slowest_seconds"] == 3.5 and doc["total_seconds"] == 4.5
    assert (doc["notebooks"], doc["ok"], doc["machine"]) == (2, 1, "x86_64, 2 CPUs")
    assert site.build_facts([], site.build_info("3", "0", "x")) == {}  # nothing ran: quoted as missing


def test_site_refuses_a_chapter_that_shows_html_as_text(checkout: pathlib.Path):
    """A placeholder inside a code span renders its `<span>` as text: the build reports it (and exits 1)."""
    checkout.joinpath("chapters", "00_demo.md").write_text("# 0 · Demo\n\nThe preset `{{ result: 00.demo.answer }}`.\n")
    out = checkout / "site"
    out.mkdir()
    out.joinpath("notebook-00_demo.html").write_text("<html><head></head><body></body></html>")
    ran = entry("00_demo", results={"demo": {"answer": 42, "sizes": [1024, 3 * 2**30]}})
    _, errors = site.write_site(out, [ran], site.build_info("3", "0", "cpu"), ["00_demo"])
    assert len(errors) == 1 and "00_demo.md: HTML shown as text" in errors[0] and "<span" in errors[0], errors


@pytest.mark.parametrize("step", [f"{i:02d}" for i in range(9)])
def test_each_step_chapter_shows_a_figure_its_notebook_draws(step: str):
    """Every step chapter (00-08) embeds at least one figure of its own notebook's run, and the notebook marks the
    cell that draws it (`# figure: NAME`, playbook/run.py)."""
    from playbook.results import FIGURE

    chapter = next(site.CHAPTERS.glob(f"{step}_*.md"))
    names = [m.group(2) for m in FIGURE.finditer(chapter.read_text()) if m.group(1) == step]
    assert names, f"{chapter.name} shows no figure of notebook {step}: add {{{{ figure: {step}.NAME }}}}"
    marked = run.FIGURE_MARK.findall(next(run.NOTEBOOKS.glob(f"{step}_*.py")).read_text())
    assert set(names) <= set(marked), (names, marked)


def test_the_raw_markup_check_flags_a_placeholder_in_code() -> None:
    from playbook import site

    body = site.render_markdown("The preset `" + '<span class="pb-result" title="x">tp</span>' + "` and <b>bold</b>.")
    assert site.raw_markup(body) == ['<span class="pb-result" title="x">', "</span>"]
