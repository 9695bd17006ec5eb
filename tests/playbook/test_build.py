"""playbook.build: a whole site built from a 2-cell fake notebook (`checkout`)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from playbook import build


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
