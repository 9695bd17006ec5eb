"""Claims: a comparison a chapter states is checked by its notebook's run (`qwen35_lib.notebook.claim`), recorded in
results.json and rendered from that record (`{{ claim: NN.name }}`); a claim that stops holding fails the build,
naming it, and a box that compares with no claim behind it fails it too (playbook/claims.py)."""

from __future__ import annotations

import json
import pathlib
import re

import jupytext
import nbformat
import pytest

from playbook import build, claims, site
from playbook.results import PlaceholderError, Results
from qwen35_lib import notebook
from tests.playbook.support import entry

STEPS = [f"{i:02d}" for i in range(9)]


def test_a_claim_is_recorded_written_and_raised_when_false(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(notebook.RESULTS_ENV, str(tmp_path))
    monkeypatch.setattr(notebook, "_CLAIMS", {})
    rec = notebook.claim_greater("attn_first", "attention ({attn:.0f} ms) costs more than the MoE ({moe:.0f} ms)",
                                 attn=1134.9, moe=82.8)
    assert rec["holds"] and rec["text"] == "attention (1135 ms) costs more than the MoE (83 ms)"
    assert rec["relation"] == "attn > moe" and "claim attn_first holds" in capsys.readouterr().out
    notebook.claim_largest("top", "{largest_name} is the largest", dict(a=1.0, b=3.0), "b", largest_name="b")
    notebook.claim_within("near", "{ratio:.2f} is near one", 0.9, 1.1, ratio=1.04)
    with pytest.raises(notebook.ClaimFailed, match=r"claim 'small' does not hold \(gdn > attn"):
        notebook.claim_greater("small", "GDN {gdn} beats attention {attn}", gdn=19, attn=653)
    written = json.loads((tmp_path / "claims.json").read_text())
    assert list(written) == ["attn_first", "top", "near", "small"] and not written["small"]["holds"]
    assert written["near"]["values"] == {"lo": 0.9, "hi": 1.1, "ratio": 1.04}
    with pytest.raises(ValueError, match="does not format"):
        notebook.claim("typo", "{nope}", True, x=1)
    with pytest.raises(ValueError, match="records no values"):
        notebook.claim("bare", "it holds", True, "a > b")


def test_a_claim_placeholder_renders_the_record_and_refuses_what_the_run_did_not_check():
    rec = dict(statement="A ({a:.1f}) beats B ({b:.1f})", text="A (2.0) beats B (1.0)", holds=True,
               relation="a > b", values=dict(a=2.0, b=1.0))
    results = Results([entry("00_demo", results={"claims": {"ab": rec, "no": dict(rec, holds=False)}}),
                       entry("01_broken", status="failed")], {"00", "01", "02"})
    text, _ = results.fill("We see {{ claim: 00.ab }}. {{ claim: 01.x }} {{ claim: 02.y }}", "c.md")
    assert 'class="pb-claim"' in text and ">2.0</span>" in text and "A (" in text
    assert 'href="results.html#claim-00-ab"' in text and text.count("pb-missing") == 2
    with pytest.raises(PlaceholderError, match="claim 00.no does not hold"):
        results.fill("{{ claim: 00.no }}", "c.md")
    with pytest.raises(PlaceholderError, match="checked no such claim; its claims: ab, no"):
        results.fill("{{ claim: 00.typo }}", "c.md")


def test_the_detector_flags_a_box_that_compares_without_a_claim():
    text = ("# T\n\n> **Box.** Attention costs {{ result: 01.a | .0f }} ms,\n> more than the MoE. It is slow.\n\n"
            "Outside a box, more is fine.\n\n> Backed: {{ claim: 01.attn_first }}, more than the MoE.\n")
    bad, _ = claims.unbacked_comparisons(text, "t.md")
    assert bad == ["t.md:3: 'more' in: **Box.** Attention costs {{ result: 01.a | .0f }} ms, more than the MoE."]


@pytest.mark.parametrize("path", site.chapter_paths(), ids=lambda p: p.name)
def test_no_chapter_box_compares_without_a_claim(path: pathlib.Path):
    bad, _ = claims.unbacked_comparisons(path.read_text(), path.name)
    assert not bad, ("a box compares with no claim behind it: check it in the notebook (notebook.claim...) and state "
                     "it as {{ claim: NN.name }}, or rephrase:\n" + "\n".join(bad))


def test_every_allowed_comparison_is_used():
    used = {u for p in site.chapter_paths() for u in claims.unbacked_comparisons(p.read_text())[1]}
    unused = [p for p, _ in claims.ALLOWED if p not in used]
    assert not unused, f"playbook.claims.ALLOWED entries no chapter uses: {unused}; remove them"


@pytest.mark.parametrize("step", STEPS)
def test_each_step_chapter_states_three_claims_its_notebook_checks_and_a_quiz(step: str):
    text = next(site.CHAPTERS.glob(f"{step}_*.md")).read_text()
    names = {m.group(2) for m in claims.CLAIM.finditer(text) if m.group(1) == step}
    assert len(names) >= 3, f"chapter {step} states {len(names)} claims of its notebook: {sorted(names)}"
    source = next(site.CHAPTERS.parents[1].joinpath("notebooks").glob(f"{step}_*.py")).read_text()
    checked = set(re.findall(r"notebook\.claim(?:_\w+)?\(\s*f?[\"']([\w\-]+)[\"']", source))
    assert names <= checked, f"chapter {step} states claims notebook {step} does not check: {names - checked}"
    assert re.search(r"<details><summary><b>(?:Pop q|Q)uiz\.</b>", text), f"chapter {step} has no quiz"
    assert "</details>" in text.split("<summary><b>", 1)[1]


CLAIM_CELL = ("from qwen35_lib import notebook\n"
              "faster, slower = {faster}, 2.0\n"
              "notebook.claim_greater('faster_wins', 'the new step ({{new:.1f}}) beats the old ({{old:.1f}})', "
              "new=faster, old=slower)")


def _claim_checkout(checkout: pathlib.Path, faster: float) -> None:
    cells = [nbformat.v4.new_markdown_cell("# 00 · Demo"), nbformat.v4.new_code_cell(CLAIM_CELL.format(faster=faster))]
    jupytext.write(nbformat.v4.new_notebook(cells=cells), checkout / "notebooks" / "00_demo.py", fmt="py:percent")
    checkout.joinpath("chapters", "00_demo.md").write_text("# 0 · Demo\n\n> **Box.** {{ claim: 00.faster_wins }}.\n")
    checkout.joinpath("chapters", "conclusion.md").write_text("# The end\n")


def test_a_claim_that_stops_holding_fails_the_build_naming_it(checkout: pathlib.Path,
                                                               capsys: pytest.CaptureFixture):
    _claim_checkout(checkout, faster=3.0)
    out = checkout / "site"
    assert build.main(["--out", str(out), "--timeout", "120"]) == 0, capsys.readouterr()
    results = json.loads(out.joinpath("results.json").read_text())
    recorded = results["notebooks"][0]["results"]["claims"]["faster_wins"]
    assert recorded["holds"] and recorded["values"] == {"new": 3.0, "old": 2.0}
    page = out.joinpath("00_demo.html").read_text()
    assert "pb-claim" in page and ">3.0</span>" in page
    assert 'id="claim-00-faster_wins"' in out.joinpath("results.html").read_text()
    capsys.readouterr()
    _claim_checkout(checkout, faster=1.5)  # one input changed: the new step no longer beats the old
    assert build.main(["--out", str(out), "--timeout", "120"]) == 1
    report = capsys.readouterr()
    assert "ClaimFailed: claim 'faster_wins' does not hold" in report.out, report.out
    assert "00_demo: 1 cells" in report.err and "FAILED: CellExecutionError: ClaimFailed" in report.err


def test_one_input_of_a_real_notebook_changed_fails_the_build_naming_its_claim(checkout: pathlib.Path,
                                                                               capsys: pytest.CaptureFixture):
    """Notebook 08 as it is, but for one input: the plan the published points are set beside (`M`) is our `kernels`
    stage itself, so its curve no longer lies above that plan's: the build fails, naming the claim its chapter states
    (`make playbook` builds the unchanged notebook, where the claim holds)."""
    root = pathlib.Path(__file__).resolve().parents[2]  # this checkout (the fixture moved site.CHAPTERS)
    source = root.joinpath("notebooks", "08_production.py").read_text()
    line = 'M = "tpu_inference_3050"'
    assert source.count(line) == 1, "notebook 08 no longer sets M where this test changes it"
    checkout.joinpath("notebooks", "08_production.py").write_text(source.replace(line, 'M = "kernels"'))
    checkout.joinpath("chapters", "08_production.md").write_text(root.joinpath(
        "playbook", "chapters", "08_production.md").read_text())
    assert "{{ claim: 08.kernels_above_3050_curve }}" in checkout.joinpath("chapters", "08_production.md").read_text()
    assert build.main(["--out", str(checkout / "site"), "--only", "08_production", "--timeout", "300"]) == 1
    report = capsys.readouterr()
    assert "ClaimFailed: claim 'kernels_above_3050_curve' does not hold" in report.out, report.out[-3000:]
    assert "08_production" in report.err and "FAILED: CellExecutionError: ClaimFailed" in report.err, report.err


def test_a_box_comparing_without_a_claim_fails_the_build(checkout: pathlib.Path):
    checkout.joinpath("chapters", "00_demo.md").write_text(
        "# 0 · Demo\n\n> The answer, {{ result: 00.demo.answer }}, is larger than before.\n")
    out = checkout / "site"
    out.mkdir()
    out.joinpath("notebook-00_demo.html").write_text("<html><head></head><body></body></html>")
    _, errors = site.write_site(out, [entry("00_demo", results={"demo": {"answer": 42, "sizes": [1, 2]}})],
                                site.build_info("3", "0", "cpu"), ["00_demo"])
    assert len(errors) == 1 and "00_demo.md:3: 'larger'" in errors[0], errors


def test_a_claim_that_opens_a_sentence_opens_with_a_capital():
    rec = dict(statement="attention ({a:.0f}) costs more", text="attention (2) costs more", holds=True, relation="",
               values=dict(a=2.0))
    results = Results([entry("00_demo", results={"claims": {"x": rec}})], {"00"})
    text, _ = results.fill("> **Box.** {{ claim: 00.x }}, and so {{ claim: 00.x }}.\n> Then. {{ claim: 00.x }}", "c")
    assert [m for m in re.findall(r'class="pb-claim"[^>]*>(\w+)', text)] == ["Attention", "attention", "Attention"]
