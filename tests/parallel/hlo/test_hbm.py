"""parallel.hlo.hbm: the HBM bytes an optimized HLO text states, by block, on hand-written texts."""

from qwen35_lib.parallel import hlo
from tests.parallel.hlo.texts import TEXT


def test_a_loop_counts_its_trips_and_an_in_place_update_only_its_slice():
    got = hlo.op_bytes(TEXT)
    row = 2 * 8 * 4  # one [2, 8] f32 slice
    # 4 trips: the slice read from the table, the row written in place (the buffer is not read); the s32 index
    assert got["bytes"]["gdn"] == 4 * (row + 4 + row)
    assert got["loops_counted_once"] == []


def test_an_async_pair_counts_once_and_a_whole_fusion_reads_its_operands():
    got = hlo.op_bytes(TEXT)["bytes"]
    whole = 16 * 8 * 4
    assert got["moe"] == 3 * whole  # two operands read, one result written
    # copy-start reads [16, 8], copy-done writes it (once, not twice); the loop counter's add, 4 trips of 3 s32
    assert got["other"] == 2 * whole + 4 * 3 * 4


def test_a_loop_without_a_trip_count_is_counted_once_and_named():
    text = TEXT.replace("%n = s32[] constant(4)", "%n = s32[] get-tuple-element(%q), index=0")
    got = hlo.op_bytes(text)
    assert got["loops_counted_once"] == ["body"]
    assert hlo.op_bytes(text, trips={"body": 4})["bytes"] == hlo.op_bytes(TEXT)["bytes"]


SCATTER = """HloModule s

%fused_scatter (param_0: f32[64,8], param_1: s32[4,1], param_2: f32[4,8]) -> f32[64,8] {
  %param_0 = f32[64,8]{1,0} parameter(0)
  %param_1 = s32[4,1]{1,0} parameter(1)
  %param_2 = f32[4,8]{1,0} parameter(2)
  ROOT %scatter.1 = f32[64,8]{1,0} scatter(%param_0, %param_1, %param_2), index_vector_dim=1, to_apply=%add
}

%greedy (g: f32[64,8]) -> f32[64,8] {
  %g = f32[64,8]{1,0} parameter(0)
  ROOT %neg = f32[64,8]{1,0} negate(%g)
}

%sampled (s: f32[64,8]) -> f32[64,8] {
  %s = f32[64,8]{1,0} parameter(0)
  %e = f32[64,8]{1,0} exponential(%s)
  ROOT %l = f32[64,8]{1,0} log(%e)
}

ENTRY %main (pool: f32[64,8], idx: s32[4,1], upd: f32[4,8], which: s32[]) -> f32[64,8] {
  %pool = f32[64,8]{1,0} parameter(0)
  %idx = s32[4,1]{1,0} parameter(1)
  %upd = f32[4,8]{1,0} parameter(2)
  %which = s32[] parameter(3)
  %fusion.1 = f32[64,8]{1,0} fusion(%pool, %idx, %upd), calls=%fused_scatter, metadata={op_name="f/attention/s"}
  ROOT %c = f32[64,8]{1,0} conditional(%which, %fusion.1, %fusion.1), branch_computations={%greedy, %sampled}
}
"""


def test_a_scatter_updates_in_place_and_a_conditional_runs_its_costliest_branch():
    got = hlo.op_bytes(SCATTER)["bytes"]
    rows = 4 * 8 * 4  # the [4, 8] f32 update
    assert got["attention"] == 4 * 4 + rows + rows  # indices and update read, the rows written: not the pool
    whole = 64 * 8 * 4
    # one branch runs: the costlier (two passes over the [64, 8]: 8 KiB), not both (12 KiB)
    assert got["other"] == 2 * (2 * whole)


def test_an_array_in_vmem_moves_no_hbm_bytes():
    # memory-space assignment's prefetch: HBM -> VMEM (S(1)) by an async copy, a fusion reading it there and writing
    # HBM: the copy reads HBM once, the fusion writes HBM once; SMEM's (S(2)) scalars are not HBM either
    text = TEXT.replace("f32[16,8]{1,0}, u32[]) copy-start(%out)",
                        "f32[16,8]{1,0:S(1)}, u32[]{:S(2)}) copy-start(%out)")
    text = text.replace("%cd = f32[16,8]{1,0} copy-done", "%cd = f32[16,8]{1,0:S(1)} copy-done")
    whole = 16 * 8 * 4
    got = hlo.op_bytes(text)["bytes"]
    assert got["moe"] == 2 * whole  # %out read from HBM, %cd from VMEM, the result written to HBM
    assert got["other"] == whole + 4 * 3 * 4  # the prefetch reads HBM; its VMEM copy and the SMEM flag move none


GATHER = """HloModule m

%gathering (p0: bf16[1024,64], p1: s32[16], p2: token[]) -> bf16[16,64] {
  %p0 = bf16[1024,64]{1,0} parameter(0)
  %p1 = s32[16]{0} parameter(1)
  %p2 = token[] parameter(2)
  ROOT %g = bf16[16,64]{1,0} gather(%p0, %p1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, \
index_vector_dim=1, slice_sizes={1,64}
}

ENTRY %main (table: bf16[1024,64], idx: s32[16]) -> bf16[16,64] {
  %table = bf16[1024,64]{1,0} parameter(0)
  %idx = s32[16]{0} parameter(1)
  %tok = token[] after-all()
  %gs = ((bf16[1024,64]{1,0}, s32[16]{0}, token[]), bf16[16,64]{1,0}) call-start(%table, %idx, %tok), \
async_execution_thread="sparsecore", to_apply=%gathering, metadata={op_name="f/model/gather"}, \
backend_config={"sparse_core_config":{"offload":"OFFLOAD_GATHER"}}
  ROOT %gd = bf16[16,64]{1,0} call-done(%gs), metadata={op_name="f/model/gather"}
}
"""


def test_a_sparsecore_gather_reads_the_rows_it_gathers_not_its_table():
    rows = 16 * 64 * 2  # the [16, 64] bf16 rows gathered, of a [1024, 64] table (128 KiB)
    got = hlo.op_bytes(GATHER)["bytes"]
    assert got["embed"] == rows + 16 * 4 + rows  # the start reads the rows and the indices, the done writes the rows
    plain = GATHER.replace('"offload":"OFFLOAD_GATHER"', '"offload":"OFFLOAD_OTHER"')
    assert hlo.op_bytes(plain)["bytes"]["embed"] == 1024 * 64 * 2 + 16 * 4 + rows  # another call reads its operands
