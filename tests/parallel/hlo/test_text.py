"""parallel.hlo.text: the computations of a text and what each calls, and the trip count of a counted loop that
carries no known_trip_count (XLA:TPU's scheduled text), on a hand-written text."""

from qwen35_lib.parallel import hlo
from tests.parallel.hlo.texts import TEXT


def test_computations_and_what_the_entry_reaches():
    comps = hlo.computations(TEXT)
    assert set(comps) == {"fused_update", "fused_add", "body", "cond", "main"}
    assert any("while(%init)" in line for line in comps["main"])
    assert hlo.called(TEXT, "main") == set(comps)  # the loop's body and condition, both fusions
    assert hlo.called(TEXT, "body") == {"body", "fused_update"}


def test_a_counted_loop_without_an_annotation_has_its_trips_read_off_the_text():
    comps = hlo.computations(TEXT)
    line = next(ln for ln in comps["main"] if " while(" in ln)
    assert hlo.counted_loop(comps, "main", line, "cond", "body") == [line, "4"]
    # a loop that steps by 2 is not a counted loop of this form: no count
    stepped = TEXT.replace("%one = s32[] constant(1)", "%one = s32[] constant(2)")
    comps = hlo.computations(stepped)
    line = next(ln for ln in comps["main"] if " while(" in ln)
    assert hlo.counted_loop(comps, "main", line, "cond", "body") is None
