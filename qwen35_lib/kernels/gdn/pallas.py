"""The gated delta rule as Pallas TPU kernels: the `gdn` slot's "pallas" implementation (twins: `gdn_xla`).

Three kernels, each reading and writing the engine's state slots `[NS, Hv, dk, dv]` in place (aliased):
- `_chunk_call`: the chunked (WY/UT) form, chunk C = 64. Grid (Hv, N chunks); the chunk axis is sequential
  and carries the `[dk, dv]` float32 state in a VMEM scratch. Each step does one chunk's intra-chunk WY/UT
  terms (on the MXU: (I + A)⁻¹ by block doubling, no triangular solve), its output and the state update.
  Scalar-prefetched per-chunk metadata says which slot a chunk's sequence uses and whether the chunk is its
  sequence's first (load the slot, or zeros for a new sequence); the state block is written back to the slot
  when the next chunk belongs to another slot (Pallas writes an output block back when its index changes),
  i.e. after each sequence's last chunk. A chunk that starts mid-sequence simply loads the slot.
- `_decode_call`: one recurrent step per sequence (decode), grid (D tokens, Hv / hb head blocks), the state
  block gathered from the token's slot by its index map; memory-bound on the state, VPU only.
- `_verify_call`: speculative verification, V = k + 1 tokens a decode row, grid (D rows, Hv / hb head blocks): the
  row's state read from its slot once, its V steps run on chip, the state after each written to the slot's
  checkpoints `[NS, V, Hv, dk, dv]` (aliased, never read) and the last to the slot: V + 2 state passes a row
  (`costmodel.ops.verify_checkpoints`), where the XLA twin's scan compiled for TPU7x moves 24 (k = 1) to 56
  (k = 3) state sizes.
Glue in XLA (cheap, O(T·H·d)): head-major transposes, repeating key heads for decode, the chunk-local cumsum
of g, padding and the per-chunk metadata. Math: fla-org/flash-linear-attention's chunked gated delta rule
(fla/ops/gated_delta_rule/chunk.py), and its XLA twin `kernels/gdn/xla.py`.

The causal conv1d is not fused here: the slot protocol (`GdnKernels.ragged`) takes conv outputs, and its
bytes are small next to the state's (decode: K-1 = 3 history rows of 2·Hk·dk + Hv·dv = 12288 channels,
72 KiB per sequence and layer at 397B in bf16, vs 4 MiB of float32 state read and 4 MiB written); in prefill it
would save one write and one read of the q, k, v conv outputs (24 KiB each per token at 397B), which XLA
already produces in one fusion. Fusing it needs the protocol to pass the conv pools; left for when a TPU
profile says it pays.

VMEM per grid step at 397B (dk = dv = 128, bf16 activations, float32 state), double-buffered blocks included:
chunk kernel ~0.6 MiB (q, k, v, o tiles of 16 KiB, state in and out 64 KiB each, 64 KiB scratch) plus
[64, 64] / [64, 128] float32 temporaries; decode kernel ~4.5 MiB with bf16 activations (16 heads' state in and
out, 1 MiB each); verify kernel at k = 3 with a bf16 state ~8.5 MiB (16 heads' checkpoints, 2 MiB a buffer;
its scoped limit raised to max(32 MiB, twice its blocks)).
All far under the 64 MiB of a TPU7x core; the tpu7x:2x2x1 compiles in the tests confirm they lower.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35_lib.kernels.registry import GdnKernels, pallas_interpret, register

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
FIRST, FRESH = 1, 2  # per-chunk flag bits: the sequence's first chunk this step; the sequence has no state yet


def _interpret(interpret):
    """None: interpret off a TPU (HLO interpreter); else as given (bool, or `pltpu.InterpretParams` for the TPU
    interpreter that simulates VMEM, DMAs and races)."""
    return pallas_interpret() if interpret is None else interpret


def _dot(a, b):  # a [m, k] @ b [k, n], float32 on the MXU
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)


def _dot_nt(a, b):  # a [m, k] @ b[n, k]ᵀ
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)


def _l2(x, axis):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-6)


def unit_lower_inverse(A):
    """(I + A)⁻¹ for A [C, C] strictly lower triangular, C a power of two, by block doubling on the MXU.

    1. Start from X = I, the inverse of the 1x1 diagonal blocks of M = I + A.
    2. For b = 1, 2, 4, ...: with X the inverse of M's b-block diagonal, the 2b-block inverse is
       X - X M_off X, where M_off holds M's entries inside the 2b blocks but outside the b blocks
       ([[P, 0], [R, Q]]⁻¹ = [[P⁻¹, 0], [-Q⁻¹ R P⁻¹, Q⁻¹]]). log2(C) steps of two [C, C] matmuls.
    Unlike a Neumann product (I - A)(I + A²)(I + A⁴)..., no intermediate exceeds the inverse's own blocks
    (A's powers grow like binomials when keys align), so float32 stays accurate.
    """
    C = A.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    X = jnp.where(row == col, 1.0, 0.0).astype(F32)
    shift = 0
    while (1 << shift) < C:
        same2b = jnp.right_shift(row, shift + 1) == jnp.right_shift(col, shift + 1)
        sameb = jnp.right_shift(row, shift) == jnp.right_shift(col, shift)
        M_off = jnp.where(same2b & ~sameb, A, 0.0)  # [C, C]
        X = X - M_off if shift == 0 else X - _dot(_dot(X, M_off), X)
        shift += 1
    return X


def _chunk_kernel(slot_ref, flag_ref, q_ref, k_ref, v_ref, gb_ref, grow_ref, s_in_ref, o_ref, s_out_ref, s_scr,
                  *, scale):
    """One (value head, chunk) step of the chunked gated delta rule.

    Refs: q, k [C, dk]; v [C, dv]; gb [C, 2] = (G, beta) with G the chunk-local cumsum of g; grow [1, C] = G as
    a row; s_in / s_out [dk, dv] (the chunk's slot, state dtype); o [C, dv]; s_scr [dk, dv] float32.
    1. At a sequence's first chunk: S = its slot (zeros for a new sequence).
    2. q, k L2-normalised (q scaled by dk^-0.5); Γ_ij = exp(G_i - G_j) for i >= j, else 0.
    3. WY/UT: A = strict_tril(beta k kᵀ ⊙ Γ); T = (I + A)⁻¹; U = T (beta v); W = T (beta e^G k).
    4. V' = U - W S; O = (e^G q) S + tril(q kᵀ ⊙ Γ) V'.
    5. S = e^G_last S + (e^(G_last - G) k)ᵀ V'; kept in VMEM for the next chunk and written to the slot block.
    """
    c = pl.program_id(1)
    flags = flag_ref[c]
    first = (flags & FIRST) != 0
    fresh = (flags & FRESH) != 0

    @pl.when(first & fresh)
    def _():
        s_scr[...] = jnp.zeros_like(s_scr)

    @pl.when(first & ~fresh)
    def _():
        s_scr[...] = s_in_ref[...].astype(F32)

    q = _l2(q_ref[...].astype(F32), -1) * scale  # [C, dk]
    k = _l2(k_ref[...].astype(F32), -1)  # [C, dk]
    v = v_ref[...].astype(F32)  # [C, dv]
    G = gb_ref[:, 0:1]  # [C, 1]
    beta = gb_ref[:, 1:2]  # [C, 1]
    C = q.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    causal = row >= col
    gamma = jnp.where(causal, jnp.exp(jnp.where(causal, G - grow_ref[...], 0.0)), 0.0)  # [C, C], exponents <= 0

    A = jnp.where(row > col, beta * _dot_nt(k, k) * gamma, 0.0)  # [C, C]
    T = unit_lower_inverse(A)
    eG = jnp.exp(G)  # [C, 1]
    U = _dot(T, beta * v)  # [C, dv]
    W = _dot(T, (beta * eG) * k)  # [C, dk]

    S = s_scr[...]  # [dk, dv]
    v_new = U - _dot(W, S)  # [C, dv]
    o = _dot(q * eG, S) + _dot(_dot_nt(q, k) * gamma, v_new)  # [C, dv]
    G_last = G[C - 1 :, :]  # [1, 1]
    k_dec = k * jnp.exp(G_last - G)  # [C, dk]
    S = S * jnp.exp(G_last) + _dot(k_dec.T, v_new)  # [dk, dv]
    s_scr[...] = S
    o_ref[...] = o.astype(o_ref.dtype)
    s_out_ref[...] = S.astype(s_out_ref.dtype)


def _chunk_call(q, k, v, gb, grow, pool, slot, flags, *, chunk: int, interpret: bool | None):
    """Run `_chunk_kernel` over N chunks of C tokens (head-major inputs), updating `pool` in place.

    q, k: [Hk, N*C, dk]; v: [Hv, N*C, dv]; gb: [Hv, N*C, 2] float32; grow: [Hv, N, 1, C] float32;
    pool: [NS, Hv, dk, dv]; slot, flags: [N] int32 (scalar-prefetched). Returns (o [Hv, N*C, dv] in v's dtype,
    pool). Chunks of one sequence must be consecutive, and a sequence's chunks must not share a slot with the
    chunks next to them (slot 0, the null slot, excepted).
    """
    Hk, _, dk = q.shape
    Hv, NC, dv = v.shape
    C, N = chunk, NC // chunk
    r = Hv // Hk
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(Hv, N),
        in_specs=[
            # q, k: value head h reads key head h // r (lax.div: jnp's floor division does not lower off-TPU)
            pl.BlockSpec((None, C, dk), lambda h, c, s, f: (jax.lax.div(h, r), c, 0)),
            pl.BlockSpec((None, C, dk), lambda h, c, s, f: (jax.lax.div(h, r), c, 0)),
            pl.BlockSpec((None, C, dv), lambda h, c, s, f: (h, c, 0)),  # v
            pl.BlockSpec((None, C, 2), lambda h, c, s, f: (h, c, 0)),  # (G, beta) columns
            pl.BlockSpec((None, None, 1, C), lambda h, c, s, f: (h, c, 0, 0)),  # G row
            pl.BlockSpec((None, None, dk, dv), lambda h, c, s, f: (s[c], h, 0, 0)),  # state slot of chunk c
        ],
        out_specs=[
            pl.BlockSpec((None, C, dv), lambda h, c, s, f: (h, c, 0)),
            pl.BlockSpec((None, None, dk, dv), lambda h, c, s, f: (s[c], h, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((dk, dv), F32)],
    )
    per_chunk = 2 * C * (2 * C * dk + C * (dk + dv) + 3 * dk * dv + C * dv)  # kkᵀ, qkᵀ, U/W, WS, qS, kᵀV', PV'
    per_chunk += 4 * C**3 * (C.bit_length() - 2)  # the block-doubling inverse
    # bytes 0: XLA's cost analysis already counts a custom call's operand and result bytes, and adds these
    cost = pl.CostEstimate(flops=Hv * N * per_chunk, transcendentals=Hv * N * (C * C + 2 * C), bytes_accessed=0)
    return pl.pallas_call(
        partial(_chunk_kernel, scale=dk**-0.5),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((Hv, NC, dv), v.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={7: 1},  # pool (operand 7, counting the 2 scalar-prefetch operands) -> output 1
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret(interpret),
        cost_estimate=cost,
        name="gdn_chunk",
    )(slot, flags, q, k, v, gb, grow, pool)


def _decode_kernel(slot_ref, fresh_ref, q_ref, k_ref, v_ref, gb_ref, s_in_ref, o_ref, s_out_ref, *, scale):
    """One recurrent step of one token for hb value heads.

    Refs: q, k [hb, dk]; v [hb, dv]; gb [hb, 2] = (g, beta); s_in / s_out [hb, dk, dv] (the token's slot);
    o [hb, dv]. q and k arrive lane-dense and are transposed here (one [hb, dk] -> [dk, hb] relayout), so that
    each head's key is a [dk, 1] column that broadcasts along the state's dv lanes.
    For each head j: 1. S = the slot's state (zeros for a new sequence) times e^g; 2. S += k ⊗ beta (v - kᵀS);
    3. o = qᵀS. Only VPU work and sublane sums: the step is bound by reading and writing the state.
    """
    d = pl.program_id(0)
    keep = fresh_ref[d] == 0
    qT = (_l2(q_ref[...].astype(F32), -1) * scale).T  # [dk, hb]
    kT = _l2(k_ref[...].astype(F32), -1).T  # [dk, hb]
    v = v_ref[...].astype(F32)  # [hb, dv]
    gb = gb_ref[...]  # [hb, 2]
    for j in range(v.shape[0]):
        S = jnp.where(keep, s_in_ref[j].astype(F32), 0.0) * jnp.exp(gb[j : j + 1, 0:1])  # [dk, dv]
        k_j = kT[:, j : j + 1]  # [dk, 1]
        kS = jnp.sum(S * k_j, axis=0, keepdims=True)  # [1, dv]
        S = S + k_j * (gb[j : j + 1, 1:2] * (v[j : j + 1] - kS))
        o_ref[j : j + 1, :] = jnp.sum(S * qT[:, j : j + 1], axis=0, keepdims=True).astype(o_ref.dtype)
        s_out_ref[j] = S.astype(s_out_ref.dtype)


def _decode_call(q, k, v, gb, pool, slot, fresh, *, interpret: bool | None):
    """Run `_decode_kernel` for D tokens (one per sequence), updating `pool` in place.

    q, k: [D, Hv, dk] (key heads already repeated to value heads); v: [D, Hv, dv]; gb: [D, Hv, 2] float32;
    pool: [NS, Hv, dk, dv]; slot, fresh: [D] int32. Returns (o [D, Hv, dv] in v's dtype, pool).
    """
    D, Hv, dk = q.shape
    dv = v.shape[-1]
    tile = 8 * 4 // v.dtype.itemsize  # rows of a sublane tile: 8 float32, 16 bfloat16 (packed in pairs)
    hb = tile if Hv % tile == 0 else Hv  # heads per step: a full sublane tile of the [hb, d] blocks (a half tile
    # of a bf16 operand is refused by Mosaic once XLA lays the operand out in (16, 128) tiles: the 397B's mixed step)
    tok = lambda d, j, s, f: (d, j, 0)
    slot_block = pl.BlockSpec((None, hb, dk, dv), lambda d, j, s, f: (s[d], j, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(D, Hv // hb),
        in_specs=[pl.BlockSpec((None, hb, dk), tok), pl.BlockSpec((None, hb, dk), tok),
                  pl.BlockSpec((None, hb, dv), tok), pl.BlockSpec((None, hb, 2), tok), slot_block],
        out_specs=[pl.BlockSpec((None, hb, dv), tok), slot_block],
    )
    cost = pl.CostEstimate(flops=8 * D * Hv * dk * dv, transcendentals=D * Hv, bytes_accessed=0)  # see _chunk_call
    return pl.pallas_call(
        partial(_decode_kernel, scale=dk**-0.5),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((D, Hv, dv), v.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret(interpret),
        cost_estimate=cost,
        name="gdn_decode",
    )(slot, fresh, q, k, v, gb, pool)


def _verify_kernel(slot_ref, fresh_ref, q_ref, k_ref, v_ref, gb_ref, s_in_ref, ck_in_ref, o_ref, s_out_ref,
                   ck_out_ref, *, scale):
    """Speculative verification: V recurrent steps of one row's tokens for hb value heads, the state kept in
    registers / VMEM between them, each step's state written to the row's checkpoint block.

    Refs: q, k [V, hb, dk]; v [V, hb, dv]; gb [V, hb, 2] = (g, beta); s_in / s_out [hb, dk, dv] (the row's slot);
    ck_in: the checkpoint pool in HBM (aliased to ck_out, never read); ck_out [V, hb, dk, dv] (the slot's
    checkpoints); o [V, hb, dv]. Each token's step is `_decode_kernel`'s; the state is read once and written
    V + 1 times (its V checkpoints and the slot), the least a verification moves (`costmodel.ops.verify_checkpoints`).
    """
    del ck_in_ref
    d = pl.program_id(0)
    keep = fresh_ref[d] == 0
    V, hb = v_ref.shape[0], v_ref.shape[1]
    qT = [(_l2(q_ref[t].astype(F32), -1) * scale).T for t in range(V)]  # V x [dk, hb]
    kT = [_l2(k_ref[t].astype(F32), -1).T for t in range(V)]
    for j in range(hb):
        S = jnp.where(keep, s_in_ref[j].astype(F32), 0.0)  # [dk, dv]
        for t in range(V):
            gb = gb_ref[t, j : j + 1, :]  # [1, 2]
            S = S * jnp.exp(gb[:, 0:1])
            k_j = kT[t][:, j : j + 1]  # [dk, 1]
            kS = jnp.sum(S * k_j, axis=0, keepdims=True)  # [1, dv]
            S = S + k_j * (gb[:, 1:2] * (v_ref[t, j : j + 1, :].astype(F32) - kS))
            o_ref[t, j : j + 1, :] = jnp.sum(S * qT[t][:, j : j + 1], axis=0, keepdims=True).astype(o_ref.dtype)
            ck_out_ref[t, j] = S.astype(ck_out_ref.dtype)
        s_out_ref[j] = S.astype(s_out_ref.dtype)


def _verify_call(q, k, v, gb, pool, ckpt, slot, fresh, *, interpret: bool | None):
    """Run `_verify_kernel` for D rows of V tokens, updating `pool` and `ckpt` in place.

    q, k: [D, V, Hv, dk] (key heads repeated to value heads); v: [D, V, Hv, dv]; gb: [D, V, Hv, 2] float32;
    pool: [NS, Hv, dk, dv]; ckpt: [NS, V, Hv, dk, dv]; slot, fresh: [D] int32. Returns (o [D, V, Hv, dv] in v's
    dtype, pool, ckpt). Grid (D, Hv / hb) as `_decode_call`'s.
    """
    D, V, Hv, dk = q.shape
    dv = v.shape[-1]
    tile = 8 * 4 // v.dtype.itemsize  # as in _decode_call
    hb = tile if Hv % tile == 0 else Hv
    tok = lambda d, j, s, f: (d, 0, j, 0)
    slot_block = pl.BlockSpec((None, hb, dk, dv), lambda d, j, s, f: (s[d], j, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(D, Hv // hb),
        in_specs=[pl.BlockSpec((None, V, hb, dk), tok), pl.BlockSpec((None, V, hb, dk), tok),
                  pl.BlockSpec((None, V, hb, dv), tok), pl.BlockSpec((None, V, hb, 2), tok), slot_block,
                  pl.BlockSpec(memory_space=pl.ANY)],  # the checkpoints: written, never read
        out_specs=[pl.BlockSpec((None, V, hb, dv), tok), slot_block,
                   pl.BlockSpec((None, V, hb, dk, dv), lambda d, j, s, f: (s[d], 0, j, 0, 0))],
    )
    block = hb * dk * dv * (pool.dtype.itemsize * 2 * 2 + V * ckpt.dtype.itemsize * 2)  # state in / out, ckpt: x2
    cost = pl.CostEstimate(flops=8 * D * V * Hv * dk * dv, transcendentals=D * V * Hv, bytes_accessed=0)
    return pl.pallas_call(
        partial(_verify_kernel, scale=dk**-0.5),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((D, V, Hv, dv), v.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                   jax.ShapeDtypeStruct(ckpt.shape, ckpt.dtype)],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=max(32 << 20, 2 * block)),
        interpret=_interpret(interpret),
        cost_estimate=cost,
        name="gdn_verify",
    )(slot, fresh, q, k, v, gb, pool, ckpt)


def _decode_step(q, k, v, g, beta, pool, slot, fresh, interpret):
    """Glue for `_decode_call` from token-major inputs: q, k [D, Hk, dk]; v [D, Hv, dv]; g, beta [D, Hv]."""
    r = v.shape[1] // k.shape[1]
    gb = jnp.stack([g, beta], -1).astype(F32)  # [D, Hv, 2]
    return _decode_call(jnp.repeat(q, r, axis=1), jnp.repeat(k, r, axis=1), v, gb, pool, slot.astype(jnp.int32),
                        fresh.astype(jnp.int32), interpret=interpret)  # o: [D, Hv, dv]


def _chunk_inputs(q, k, v, g, beta, C):
    """Head-major chunk-kernel inputs from [T, H, .] tokens (T a multiple of C): q, k, v, gb, grow."""
    T, Hv = g.shape
    hm = lambda x: jnp.swapaxes(x, 0, 1)  # [T, H, d] -> [H, T, d]
    G = jnp.cumsum(hm(g.astype(F32)).reshape(Hv, T // C, C), axis=-1)  # [Hv, N, C] chunk-local cumsum
    gb = jnp.stack([G.reshape(Hv, T), hm(beta.astype(F32))], -1)  # [Hv, T, 2]
    return hm(q), hm(k), hm(v), gb, G[:, :, None, :]


def gdn_dense_pallas(q, k, v, g, beta, state, chunk_size: int = 64, *, interpret: bool | None = None):
    """The `dense` protocol: q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; state [B, Hv, dk, dv].

    1. T == 1: the decode kernel, slot b = row b.
    2. Else: pad each row to N chunks (g = beta = 0 leaves the state alone), flatten the rows into B·N chunks
       where row b's chunks use slot b, and run the chunk kernel once.
    Returns (o [B, T, Hv, dv] in v's dtype, state float32), like `gdn_xla`.
    """
    B, T, Hv = g.shape
    pool = state.astype(F32)
    rows = jnp.arange(B, dtype=jnp.int32)
    if T == 1:
        o, pool = _decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool, rows, jnp.zeros_like(rows),
                               interpret)
        return o[:, None], pool
    C = chunk_size
    N = -(-T // C)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 2))
    flat = lambda x: pad(x).reshape(B * N * C, *x.shape[2:])  # [B*N*C, ...]
    inputs = _chunk_inputs(*map(flat, (q, k, v, g, beta)), C)
    flags = jnp.where(jnp.arange(B * N) % N == 0, FIRST, 0).astype(jnp.int32)
    o, pool = _chunk_call(*inputs, pool, jnp.repeat(rows, N), flags, chunk=C, interpret=interpret)
    o = jnp.swapaxes(o, 0, 1).reshape(B, N * C, Hv, -1)[:, :T]  # [B, T, Hv, dv]
    return o, pool


def _ragged_pallas(q, k, v, g, beta, states, meta, checkpoints=None, chunk_size: int = 64, *,
                   interpret: bool | None = None):
    """The `ragged` protocol over one rank (see `gdn.xla.gdn_ragged_xla` for the layout and shapes).

    1. Decode region [0, N): the decode kernel, token i reading and writing the slot of sequence i (zeros for a
       new sequence; padding tokens use the null slot 0 with zeros); with `checkpoints` [NS, V, Hv, dk, dv]
       (speculative verification) N = D V, row i's V tokens through the verify kernel, the state after each into
       its slot's checkpoints (a padding row's into the null slot's, as the XLA twin writes them).
    2. Prefill region [N, T): the chunk kernel over its (T - N) / C chunks; a chunk is FIRST when it starts
       its sequence's tokens this step (the sequence then continues from its slot, possibly mid-sequence),
       FRESH when the sequence has no context before this step; padding chunks are both, on slot 0.
    Returns (o [T, Hv, dv] in v's dtype, states), and the checkpoints when given.
    """
    C = chunk_size
    D, T = meta.decode_seq.shape[0], q.shape[0]
    N = D if checkpoints is None else D * checkpoints.shape[1]
    fresh = meta.kv_len == meta.q_len  # [S]
    outs = []
    if D:
        dseq = meta.decode_seq  # [D]
        ds = jnp.clip(dseq, 0)
        dslot, dfresh = jnp.where(dseq >= 0, meta.slot[ds], 0), (dseq < 0) | fresh[ds]
        if checkpoints is None:
            o_dec, states = _decode_step(q[:D], k[:D], v[:D], g[:D], beta[:D], states, dslot, dfresh, interpret)
        else:
            V, r = checkpoints.shape[1], v.shape[1] // k.shape[1]
            rows = lambda x: x[:N].reshape(D, V, *x.shape[1:])
            gb = jnp.stack([rows(g), rows(beta)], -1).astype(F32)  # [D, V, Hv, 2]
            o_dec, states, checkpoints = _verify_call(
                jnp.repeat(rows(q), r, axis=2), jnp.repeat(rows(k), r, axis=2), rows(v), gb, states, checkpoints,
                dslot.astype(jnp.int32), dfresh.astype(jnp.int32), interpret=interpret)
            o_dec = o_dec.reshape(N, *o_dec.shape[2:])
        outs.append(o_dec)
    if T > N:
        n = (T - N) // C
        first_tok = N + jnp.arange(n) * C
        cseq = meta.token_seq[first_tok]  # [n], -1 for padding chunks
        cs = jnp.clip(cseq, 0)
        pad = cseq < 0
        first = pad | (first_tok == meta.q_start[cs])
        flags = jnp.where(first, FIRST, 0) | jnp.where(pad | fresh[cs], FRESH, 0)
        slot = jnp.where(pad, 0, meta.slot[cs])
        inputs = _chunk_inputs(q[N:], k[N:], v[N:], g[N:], beta[N:], C)
        o_pre, states = _chunk_call(*inputs, states, slot.astype(jnp.int32), flags.astype(jnp.int32), chunk=C,
                                    interpret=interpret)
        outs.append(jnp.swapaxes(o_pre, 0, 1))  # [T - N, Hv, dv]
    if not outs:  # an empty step
        outs.append(jnp.zeros((0, *v.shape[1:]), v.dtype))
    o = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
    return (o, states) if checkpoints is None else (o, states, checkpoints)


def gdn_ragged_pallas(q, k, v, g, beta, states, meta, chunk_size: int = 64, *, interpret: bool | None = None,
                      checkpoints=None):
    """`_ragged_pallas`, batched over data-parallel ranks (the model vmaps it) by a loop over ranks."""
    fn = jax.custom_batching.custom_vmap(partial(_ragged_pallas, chunk_size=chunk_size, interpret=interpret))

    @fn.def_vmap
    def _(axis_size, in_batched, *args):
        widen = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
        out = jax.lax.map(lambda xs: fn(*xs), jax.tree.map(widen, tuple(args), tuple(in_batched)))
        return out, (True,) * len(out)

    extra = () if checkpoints is None else (checkpoints,)
    return fn(q, k, v, g, beta, states, meta, *extra)


register("gdn", "pallas", per_platform=True)(lambda platform: GdnKernels(
    dense=partial(gdn_dense_pallas, interpret=pallas_interpret(platform)),
    ragged=partial(gdn_ragged_pallas, interpret=pallas_interpret(platform))))
