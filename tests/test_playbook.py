"""The playbook builder's pieces: placeholders, navigation, and a whole site from a 2-cell fake notebook."""

from __future__ import annotations

import json
import pathlib
import re

import jupytext
import nbformat
import pytest

from playbook import build, run, site
from playbook.results import PlaceholderError, Results, flatten, format_value

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="  # 1 x 1
NOTEBOOK_CELLS = [
    nbformat.v4.new_markdown_cell("# 00 · Demo: does the builder work?"),
    nbformat.v4.new_code_cell(
        "import json, os, pathlib\n"
        "if os.environ.get('QWEN35_RESULTS_DIR'):\n"
        "    pathlib.Path(os.environ['QWEN35_RESULTS_DIR'], 'demo.json').write_text("
        "json.dumps({'answer': 42, 'sizes': [1024, 3 * 2**30]}))\n"
        "print('hello from the demo')"),
    nbformat.v4.new_code_cell(
        "# figure: dot\n"
        "import base64\nfrom IPython.display import Image, display\n"
        f"display(Image(data=base64.b64decode({PNG!r})))"),
]


def entry(name: str, status: str = "ok", results: dict | None = None) -> dict:
    return dict(name=name, title=name, status=status, seconds=1.0, cells=2, html=f"notebook-{name}.html",
                error=None if status == "ok" else "CellExecutionError: boom", results=results or {})


def test_flatten_and_format():
    assert flatten({"a": {"b": [1, 2]}, "c": "x"}) == {"a.b.0": 1, "a.b.1": 2, "c": "x"}
    assert format_value(1234567, None) == "1,234,567"
    assert format_value(3 * 2**30, "bytes") == "3.00 GiB"
    assert format_value(3.1049, "x") == "3.10x"
    assert format_value(0.5, ".0%") == "50%"
    assert format_value(True, None) == "yes"
    with pytest.raises(TypeError):
        format_value({"a": 1}, None)


def test_placeholders_filled_missing_or_refused():
    results = Results([entry("00_demo", results={"demo": {"answer": 42, "ratio": 4.71}}),
                       entry("01_broken", status="failed")], steps={"00", "01", "02"})
    text, values = results.fill("a {{ result: 00.demo.answer }} b {{result:00.demo.ratio|x}}", "ch.md")
    assert "42" in text and "4.71x" in text and "{{" not in text
    assert [v.path for v in values] == ["00.demo.answer", "00.demo.ratio"]
    # a notebook that failed, or did not run: shown as missing, never invented
    text, values = results.fill("{{ result: 01.x.y }} {{ result: 02.x.y }}", "ch.md")
    assert [v.text for v in values] == [None, None]
    assert "failed" in values[0].reason and "did not run" in values[1].reason
    assert text.count("pb-missing") == 2
    # a notebook that ran and did not produce the value, or a step that does not exist: the build fails
    with pytest.raises(PlaceholderError) as error:
        results.fill("{{ result: 00.demo.nope }} {{ result: 09.demo.answer }}", "ch.md")
    assert "00.demo.nope" in str(error.value) and "00.demo.answer" in str(error.value)  # names what exists
    assert "no step '09'" in str(error.value)


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


@pytest.fixture
def checkout(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A checkout with one fake notebook and three chapters quoting its results."""
    notebooks, chapters = tmp_path / "notebooks", tmp_path / "chapters"
    notebooks.mkdir()
    chapters.mkdir()
    jupytext.write(nbformat.v4.new_notebook(cells=NOTEBOOK_CELLS), notebooks / "00_demo.py", fmt="py:percent")
    chapters.joinpath("introduction.md").write_text("# Intro\n\nSee {{ source: qwen35_lib }}.\n")
    chapters.joinpath("00_demo.md").write_text("# 0 · Demo\n\nThe answer is {{ result: 00.demo.answer }}.\n\n"
                                               "{{ figure: 00.dot }}\n")
    chapters.joinpath("conclusion.md").write_text(
        "# The end\n\n| what | value |\n|---|---|\n| size | {{ result: 00.demo.sizes.1 | bytes }} |\n"
        "| later | {{ result: 01.ladder.gain | x }} |\n")
    chapters.joinpath("01_later.md").write_text("# 1 · Later\n\nNo notebook yet.\n")
    monkeypatch.setattr(run, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(site, "CHAPTERS", chapters)
    return tmp_path


def test_site_built_from_a_fake_notebook(checkout: pathlib.Path, capsys: pytest.CaptureFixture):
    out = checkout / "site"
    assert build.main(["--out", str(out), "--timeout", "120"]) == 0
    report = capsys.readouterr()
    assert "00.demo.sizes.1" in report.out and "3.00 GiB" in report.out  # the key results table
    assert "missing" in report.out and "[1/1] 00_demo" in report.err  # progress on stderr
    pages = {p.name for p in out.glob("*.html")}
    assert pages == {"index.html", "introduction.html", "00_demo.html", "notebook-00_demo.html", "01_later.html",
                     "conclusion.html", "results.html", "explorer.html"}
    assert "The answer is <span" in out.joinpath("00_demo.html").read_text() and ">42<" in (
        out / "00_demo.html").read_text()
    assert "not in this checkout" in out.joinpath("01_later.html").read_text()
    demo = out.joinpath("00_demo.html").read_text()  # the figure, drawn by the run, linked to its notebook
    assert '<img src="figures/00_demo-dot.png"' in demo and 'href="explorer.html"' in demo, demo
    assert out.joinpath("figures", "00_demo-dot.png").read_bytes().startswith(b"\x89PNG")
    notebook_page = out.joinpath("notebook-00_demo.html").read_text()
    assert "hello from the demo" in notebook_page and 'class="pb-nav"' in notebook_page
    conclusion = out.joinpath("conclusion.html").read_text()
    assert "<table>" in conclusion and "3.00 GiB" in conclusion and "pb-missing" in conclusion
    assert "qwen35_lib</code></a>" in out.joinpath("introduction.html").read_text()
    assert "00.demo.answer" in out.joinpath("results.html").read_text()
    results = json.loads(out.joinpath("results.json").read_text())
    assert results["notebooks"][0]["results"] == {"demo": {"answer": 42, "sizes": [1024, 3 * 2**30]}}
    for page in pages:  # every page links only to pages that exist
        for link in re.findall(r'href="([^"#:]+\.html)"', out.joinpath(page).read_text()):
            assert link in pages, (page, link)


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


def test_a_figure_the_notebook_did_not_draw_is_refused_and_one_not_run_is_missing():
    ran = entry("00_demo", results={"demo": {}})
    ran["figures"] = {"dot": "figures/00_demo-dot.png"}
    results = Results([ran], {"00", "01"})
    filled, _ = results.fill("{{ figure: 00.dot }} and {{ figure: 01.curve }}", "x.md")
    assert 'src="figures/00_demo-dot.png"' in filled and "figure curve missing" in filled
    with pytest.raises(PlaceholderError, match="drew no cell marked '# figure: typo'; its figures: dot"):
        results.fill("{{ figure: 00.typo }}", "x.md")
    with pytest.raises(PlaceholderError, match="no step '09'"):
        results.fill("{{ figure: 09.dot }}", "x.md")


def test_site_refuses_a_chapter_that_shows_html_as_text(checkout: pathlib.Path):
    """A placeholder inside a code span renders its `<span>` as text: the build reports it (and exits 1)."""
    checkout.joinpath("chapters", "00_demo.md").write_text("# 0 · Demo\n\nThe preset `{{ result: 00.demo.answer }}`.\n")
    out = checkout / "site"
    out.mkdir()
    out.joinpath("notebook-00_demo.html").write_text("<html><head></head><body></body></html>")
    ran = entry("00_demo", results={"demo": {"answer": 42, "sizes": [1024, 3 * 2**30]}})
    _, errors = site.write_site(out, [ran], site.build_info("3", "0", "cpu"), ["00_demo"])
    assert len(errors) == 1 and "00_demo.md: HTML shown as text" in errors[0] and "<span" in errors[0], errors


def test_the_primer_quotes_the_librarys_hardware_and_nothing_is_missing():
    """Every placeholder of chapters/primer.md fills from `playbook.facts` (no notebook runs for it), and the
    values are the library's: the TPU7x usable HBM per device, the ridge point, a decode step's copies per expert."""
    from playbook import facts
    from qwen35_lib import hardware

    text = (site.CHAPTERS / "primer.md").read_text()
    filled, values = Results([], set(), facts={facts.STEP: facts.documents()}).fill(text, "primer.md")
    assert values and all(v.text is not None for v in values) and "{{ result" not in filled
    got = {v.path: v.text for v in values}
    hw = hardware.get("tpu7x-8")
    assert got["primer.systems.tpu7x-8.usable_hbm_bytes_per_device"] == format_value(
        hw.usable_hbm_bytes_per_device, "bytes")
    ridge = hw.peak_bf16_flops_per_chip / hw.hbm_bytes_per_s_per_chip
    assert got["primer.systems.tpu7x-8.ridge_bf16"] == f"{ridge:.0f}"
    assert got["primer.decode.qwen3.5-397b-a17b.copies_per_expert"] == "10"  # 512 requests x top-10 / 512 experts


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
