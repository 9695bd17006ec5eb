"""Hand-written optimized HLO texts the hlo readers' tests share."""

# a loop of 4 trips whose body updates one [2,8] row of a [16,8] f32 buffer in place from a slice of a [64,8]
# table, a fusion reading two whole arrays, and an async copy
TEXT = """HloModule m

%fused_update (param_0: f32[16,8], param_1: f32[64,8], param_2: s32[]) -> f32[16,8] {
  %param_0 = f32[16,8]{1,0} parameter(0)
  %param_1 = f32[64,8]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %dynamic-slice.1 = f32[2,8]{1,0} dynamic-slice(%param_1, %param_2, %zero), dynamic_slice_sizes={2,8}
  ROOT %dynamic-update-slice.1 = f32[16,8]{1,0} dynamic-update-slice(%param_0, %dynamic-slice.1, %param_2, %zero)
}

%fused_add (param_0.1: f32[16,8], param_1.1: f32[16,8]) -> f32[16,8] {
  %param_0.1 = f32[16,8]{1,0} parameter(0)
  %param_1.1 = f32[16,8]{1,0} parameter(1)
  ROOT %add.1 = f32[16,8]{1,0} add(%param_0.1, %param_1.1)
}

%body (p: (s32[], f32[16,8], f32[64,8])) -> (s32[], f32[16,8], f32[64,8]) {
  %p = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %buf = f32[16,8]{1,0} get-tuple-element(%p), index=1
  %table = f32[64,8]{1,0} get-tuple-element(%p), index=2
  %fusion.1 = f32[16,8]{1,0} fusion(%buf, %table, %i), kind=kLoop, calls=%fused_update, metadata={op_name="f/gdn/x"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) tuple(%next, %fusion.1, %table)
}

%cond (q: (s32[], f32[16,8], f32[64,8])) -> pred[] {
  %q = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (a: f32[16,8], b: f32[64,8]) -> f32[16,8] {
  %a = f32[16,8]{1,0} parameter(0)
  %b = f32[64,8]{1,0} parameter(1)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) tuple(%c0, %a, %b)
  %w = (s32[], f32[16,8]{1,0}, f32[64,8]{1,0}) while(%init), condition=%cond, body=%body
  %out = f32[16,8]{1,0} get-tuple-element(%w), index=1
  %cs = (f32[16,8]{1,0}, f32[16,8]{1,0}, u32[]) copy-start(%out)
  %cd = f32[16,8]{1,0} copy-done(%cs)
  ROOT %fusion.2 = f32[16,8]{1,0} fusion(%out, %cd), kind=kLoop, calls=%fused_add, metadata={op_name="f/moe/x"}
}
"""
