"""playbook.results: flattening and formatting, placeholders filled, missing or refused, figures drawn or not."""

from __future__ import annotations

import pytest

from playbook.results import PlaceholderError, Results, flatten, format_value
from tests.playbook.support import entry


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
