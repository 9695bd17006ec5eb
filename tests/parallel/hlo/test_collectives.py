"""parallel.hlo.collectives: the collectives of a hand-written text, their bytes and groups, and what one run
executes per device (a loop body's ops times its trips, a conditional's refused)."""

import pytest

from qwen35_lib.parallel import hlo

# an all-gather of [2,8] f32 in groups of 4 inside a loop of 3 trips, a reduce-scatter in the entry over all 8
TEXT = """HloModule m, num_partitions=8

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %s = f32[2,8]{1,0} slice(%x), slice={[0:2], [0:8]}
  %ag = f32[8,8]{1,0} all-gather(%s), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%next, %ag)
}

%cond (q: (s32[], f32[8,8])) -> pred[] {
  %q = (s32[], f32[8,8]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

ENTRY %main (x0: f32[8,8]) -> f32[1,8] {
  %x0 = f32[8,8]{1,0} parameter(0)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%c0, %x0)
  %w = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body
  %y = f32[8,8]{1,0} get-tuple-element(%w), index=1
  ROOT %rs = f32[1,8]{1,0} reduce-scatter(%y), channel_id=2, replica_groups={}, dimensions={0}, to_apply=%add
}
"""


def test_each_collective_with_its_bytes_group_and_computation():
    ops = hlo.collectives(TEXT)
    assert [(c.kind, c.computation, c.bytes, c.group) for c in ops] == [
        ("all-gather", "body", 256, 4), ("reduce-scatter", "main", 32, 8)]
    assert [c.moved for c in ops] == [256, 256]  # a reduce-scatter moves its input: result x its group
    assert hlo.layer_body(TEXT) == "body"
    assert hlo.count(TEXT, "body") == {"all-gather": {"count": 1, "bytes": 256}}


def test_one_run_executes_the_loop_bodys_collectives_once_a_trip():
    assert hlo.step_counts(TEXT) == {"all-gather": {"count": 3, "bytes": 768},
                                     "reduce-scatter": {"count": 1, "bytes": 256}}


def test_a_collective_whose_runs_depend_on_the_data_is_refused():
    unbounded = TEXT.replace("%n = s32[] constant(3)", "%n = s32[] parameter(1)")  # no counted loop any more
    with pytest.raises(ValueError, match="inside the loop 'body', whose trip count XLA does not know"):
        hlo.step_counts(unbounded)
