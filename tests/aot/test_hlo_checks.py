"""The scheduled-HLO readers on a small hand-written module: a layer loop with expert-weight copies and a
hierarchical reduce-scatter in two micro-batches (async pairs over 2 then 4 devices), a SparseCore-offloaded
collective, and the errors that name what is missing."""

from __future__ import annotations

import pytest

from qwen35_lib.aot import hlo_checks as hc

RS2 = "replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, to_apply=%add"  # over `core`: groups of 2
RS4 = "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add"  # over `chip`: groups of 4
HLO = f"""HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%fused_w (p: bf16[2,64,2,32]) -> bf16[2,64,2,32] {{
  %p = bf16[2,64,2,32]{{3,2,1,0}} parameter(0)
  ROOT %n = bf16[2,64,2,32]{{3,2,1,0}} negate(%p)
}}

%sc_rs (x: f32[8,64]) -> f32[4,64] {{
  %x = f32[8,64]{{1,0}} parameter(0)
  ROOT %rs.sc = f32[4,64]{{1,0}} reduce-scatter(%x), {RS2}
}}

%cond (c: (s32[], f32[8,64], bf16[2,64,2,32])) -> pred[] {{
  %c = (s32[], f32[8,64]{{1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) parameter(0)
  ROOT %lt = pred[] constant(true)
}}

%body (t: (s32[], f32[8,64], bf16[2,64,2,32])) -> (s32[], f32[8,64], bf16[2,64,2,32]) {{
  %t = (s32[], f32[8,64]{{1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,64]{{1,0}} get-tuple-element(%t), index=1
  %w = bf16[2,64,2,32]{{3,2,1,0}} get-tuple-element(%t), index=2
  %w.copy = bf16[2,64,2,32]{{3,2,1,0}} copy(%w)
  %w.f = bf16[2,64,2,32]{{3,2,1,0}} fusion(%w.copy), kind=kLoop, calls=%fused_w
  %down = f8e4m3fn[2,32,64]{{2,1,0}} copy(%w)
  %x.c = f32[8,64]{{1,0}} copy(%x)
  %rs1.a = f32[4,64]{{1,0}} reduce-scatter-start(%x), {RS2}
  %rs1.b = f32[4,64]{{1,0}} reduce-scatter-start(%x.c), {RS2}
  %rs1.a.done = f32[4,64]{{1,0}} reduce-scatter-done(%rs1.a)
  %rs2.a = f32[1,64]{{1,0}} reduce-scatter-start(%rs1.a.done), {RS4}
  %rs1.b.done = f32[4,64]{{1,0}} reduce-scatter-done(%rs1.b)
  %rs2.a.done = f32[1,64]{{1,0}} reduce-scatter-done(%rs2.a)
  %rs2.b = f32[1,64]{{1,0}} reduce-scatter-start(%rs1.b.done), {RS4}
  %rs2.b.done = f32[1,64]{{1,0}} reduce-scatter-done(%rs2.b)
  ROOT %out = (s32[], f32[8,64]{{1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) tuple(%i, %x, %w.f)
}}

ENTRY %main (x: f32[8,64], w: bf16[2,64,2,32]) -> f32[4,64] {{
  %x = f32[8,64]{{1,0}} parameter(0)
  %w = bf16[2,64,2,32]{{3,2,1,0}} parameter(1)
  %w.entry = bf16[2,64,2,32]{{3,2,1,0}} copy(%w)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,64]{{1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) tuple(%zero, %x, %w.entry)
  %loop = (s32[], f32[8,64]{{1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) while(%init), condition=%cond, body=%body
  %cs = ((f32[8,64]{{1,0}}), f32[4,64]{{1,0}}) call-start(%x), async_execution_thread="sparsecore", to_apply=%sc_rs
  %ar = f32[8,64]{{1,0}} all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %cd = f32[4,64]{{1,0}} call-done(%cs)
}}
"""


def test_instructions_in_schedule_order_with_their_result_arrays():
    body = hc.instructions(HLO, {"body"})
    assert [i.name for i in body[:4]] == ["t", "i", "x", "w"]
    assert all(i.computation == "body" for i in body)
    w = next(i for i in body if i.name == "w.copy")
    assert (w.op, w.arrays) == ("copy", (("bf16", (2, 64, 2, 32)),))
    t = body[0]
    assert t.op == "parameter" and t.arrays == (("s32", ()), ("f32", (8, 64)), ("bf16", (2, 64, 2, 32)))
    everything = hc.instructions(HLO)
    assert {i.computation for i in everything} == {"add", "fused_w", "sc_rs", "cond", "body", "main"}
    assert everything[-1].name == "cd" and everything[-1].op == "call-done"


def test_the_loop_body_and_its_expert_weight_copies():
    assert hc.loop_body(HLO) == {"body", "fused_w", "add"}
    copies = hc.expert_weight_copies(HLO, local_experts=2, hidden=64, ffn=32)
    assert [i.name for i in copies] == ["w.copy", "w.f", "down"]  # not the f32 copy, not the one outside the loop
    assert hc.expert_weight_copies(HLO, local_experts=4, hidden=64, ffn=32) == []
    with pytest.raises(ValueError, match="no layer loop with collectives.*at least 2 layer groups"):
        hc.loop_body(HLO.replace("while(%init), condition=%cond, body=%body", "tuple(%init)"))


def test_group_sizes_of_both_replica_group_forms():
    assert hc.group_size(RS2) == 2 and hc.group_size(RS4) == 4
    assert hc.group_size("replica_groups=[1,8]<=[8]") == 8
    with pytest.raises(ValueError, match="no replica_groups in %x = f32"):
        hc.group_size("%x = f32[8] all-reduce(%y)")


def test_collective_schedule_pairs_starts_with_dones():
    ops = hc.collective_schedule(HLO, "body", ("reduce-scatter",))
    pos = {i.name: n for n, i in enumerate(hc.instructions(HLO, {"body"}))}
    assert [(o.name, o.start, o.done, o.group_size, o.how) for o in ops] == [
        ("rs1.a", pos["rs1.a"], pos["rs1.a.done"], 2, "async"), ("rs1.b", pos["rs1.b"], pos["rs1.b.done"], 2, "async"),
        ("rs2.a", pos["rs2.a"], pos["rs2.a.done"], 4, "async"), ("rs2.b", pos["rs2.b"], pos["rs2.b.done"], 4, "async")]
    main = hc.collective_schedule(HLO, "main", ("reduce-scatter", "all-reduce"))
    assert [(o.kind, o.how, o.group_size) for o in main] == [("reduce-scatter", "sparsecore", 2),
                                                             ("all-reduce", "sync", 8)]
    sync = main[1]
    assert sync.start == sync.done
    with pytest.raises(ValueError, match="rs2.b has no reduce-scatter-done in body"):
        hc.collective_schedule(HLO.replace("reduce-scatter-done(%rs2.b)", "copy(%rs2.b)"), "body", ("reduce-scatter",))


def test_ancestors_follow_data_dependencies_only():
    assert hc.ancestors(HLO, "body", "rs2.a") == {"rs1.a.done", "rs1.a", "x", "t"}
    assert "rs1.b" not in hc.ancestors(HLO, "body", "rs2.a")
    assert hc.ancestors(HLO, "body", "rs2.b") == {"rs1.b.done", "rs1.b", "x.c", "x", "t"}


def test_rs_chains_and_their_overlap():
    chains = hc.rs_chains(HLO, "body")
    assert [(a.name, b.name) for a, b in chains] == [("rs1.a", "rs2.a"), ("rs1.b", "rs2.b")]
    assert hc.overlapped(chains, 2) == [True]  # micro-batch b's phase 1 starts before a's phase 2 is done
    assert hc.overlapped(chains, 1) == [False, False]  # one micro-batch a layer: nothing to overlap
    late = [(a, b) for a, b in chains]
    late[1] = (late[1][0].__class__(**{**late[1][0].__dict__, "start": late[0][1].done + 1}), late[1][1])
    assert hc.overlapped(late, 2) == [False]
    broken = HLO.replace("reduce-scatter-start(%rs1.b.done)", "reduce-scatter-start(%x)")
    with pytest.raises(ValueError, match="phase-2 reduce-scatter rs2.b depends on no phase-1 reduce-scatter"):
        hc.rs_chains(broken, "body")
