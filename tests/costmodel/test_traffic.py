"""The stored TPU7x-8 sweep (`data/aot/tpu7x-8.json`, every stage's decode and mixed step compiled at full depth)
against the cost model's closed form (`costmodel.traffic`), per step kind: every collective kind the compile runs,
its count and its bytes (by `parallel.hlo.MOVED`'s convention) equal the model's within 1%, and the model has no kind
the compile lacks. The record is written by `python -m qwen35_lib.aot sweep`; these tests re-derive the model's side
from today's code, so a change to the plan or the padding that the sweep has not been refreshed for fails here."""

from __future__ import annotations

import jax
import pytest

from qwen35_lib import data
from qwen35_lib.costmodel import traffic
from qwen35_lib.plan import get_stage

DOC = data.read_json("aot/tpu7x-8.json")
ENTRIES = [(stage, step) for stage, s in DOC["stages"].items() for step, e in s["steps"].items()
           if e.get("collectives") and not e.get("same_program_as")]


def _model(stage: str, entry: dict) -> dict:
    from jax.sharding import AbstractMesh

    from qwen35_lib.aot.sweep import serving_config
    from qwen35_lib.plan import AXES

    cfg = serving_config(DOC["model"], DOC["groups"], **DOC.get("overrides", {}))
    plan = get_stage(stage).bind(AbstractMesh((4, 2), AXES))  # tpu7x:2x2x1's (chip, core), no libtpu needed
    shape = traffic.StepShape.of_compile(cfg, plan.dp, DOC["shape"]["requests"], entry["decode_tokens_per_rank"],
                                         entry["prefill_tokens_per_rank"])
    return traffic.collective_counts(plan, cfg, shape, backend="tpu")


def test_every_compiled_step_kind_is_in_the_record():
    kinds = {(stage, step.split()[-1]) for stage, step in ENTRIES}
    for stage in ("dp_ep", "replicate", "fused_ag", "hier_rs", "kernels"):
        assert {(stage, "decode"), (stage, "mixed")} <= kinds, stage


@pytest.mark.parametrize("stage, step", ENTRIES)
def test_compiled_collectives_are_the_models(stage, step):
    entry = DOC["stages"][stage]["steps"][step]
    got = {k: v for k, v in entry["collectives"].items() if v["count"]}
    want = {k: v for k, v in _model(stage, entry).items() if v[0]}
    assert set(got) == set(want), (sorted(got), sorted(want))
    for kind, (count, nbytes) in want.items():
        assert got[kind]["count"] == count, (kind, got[kind], count)
        assert got[kind]["bytes"] == pytest.approx(nbytes, rel=0.01), (kind, got[kind], nbytes)


def test_an_async_collective_counts_its_result_not_its_context_scalars():
    """A TPU collective-permute-start returns (operand, result, u32[] contexts): its bytes are the result's (the
    parser once took the last shape, a 4-byte context); an all-gather-start's are its gathered result's."""
    from qwen35_lib.parallel import hlo

    text = "\n".join([
        "ENTRY %main {",
        "  %cp = (bf16[136,4096]{1,0}, bf16[136,4096]{1,0}, u32[], u32[]) collective-permute-start(bf16[136,4096]{1,0}"
        " %x), source_target_pairs={{0,1}}",
        "  %ag = (bf16[8,4096]{1,0}, bf16[64,4096]{1,0}) all-gather-start(bf16[8,4096]{1,0} %y), "
        "replica_groups=[1,8]<=[8], dimensions={0}",
        "  %ar = pred[] all-reduce(pred[] %z), replica_groups=[1,8]<=[8]",
        "}"])
    got = [(c.kind, c.bytes) for c in hlo.collectives(text)]
    assert got == [("collective-permute", 136 * 4096 * 2), ("all-gather", 64 * 4096 * 2), ("all-reduce", 1)]


def test_sizes_placed_and_per_device_bytes():
    """The helpers `temporaries` shares: a bound plan's mesh sizes (an unbound one refused with the fix), the config
    as the plan places it, and the bytes one device holds of each top-level part (qwen3.5-tiny, bf16, dp8_ep8:
    everything replicated but the routed experts, 1 of 8 per device)."""
    from jax.sharding import AbstractMesh

    from qwen35_lib import get_config
    from qwen35_lib.plan import AXES, get_layout
    from qwen35_lib.weights import declare, is_info

    mesh = AbstractMesh((4, 2), AXES)
    tiny = get_config("qwen3.5-tiny")
    ep = get_layout("dp8_ep8").bind(mesh, tiny)
    assert traffic.sizes(ep) == (8, 4, 2)
    with pytest.raises(ValueError, match="has no mesh: bind it first"):
        traffic.sizes(get_layout("dp8_ep8"))
    held = traffic.per_device(ep, declare(tiny))
    full = {k: sum(i.nbytes for i in jax.tree.leaves(v, is_leaf=is_info))
            for k, v in declare(tiny).items()}
    routed = 4 * 8 * (64 * 2 * 32 + 32 * 64) * 2  # 4 layers x 8 experts x (gate_up + down) x 2 bytes
    assert held == {**full, "layers": full["layers"] - routed + routed // 8}
    wide = tiny.replace(num_q_heads=8)  # 4 query heads per KV head: tp8_kvrep keeps 4 copies of each
    assert get_layout("tp8_kvrep").bind(mesh, wide).placed(wide).num_kv_heads == 8
    assert ep.placed(tiny) == tiny == ep.config
