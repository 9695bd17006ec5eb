"""The gated delta rule in XLA: chunked (sequences) and recurrent (single steps) forms, the `gdn` slot's twins.

Shapes: q, k [B, T, Hk, dk] (conv outputs, before the L2 norm); v [B, T, Hv, dv]; g (log decay, <= 0) and
beta [B, T, Hv] float32; state [B, Hv, dk, dv] float32. Value head h reads key head h // (Hv // Hk).
Math: HF transformers' `Qwen3_5MoeGatedDeltaNet` (models/qwen3_5_moe/modeling_qwen3_5_moe.py) and the chunked form
of fla-org/flash-linear-attention (fla/ops/gated_delta_rule/chunk.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.registry import GdnKernels, register


def _prepare(q, k, v, g, beta):
    """L2-normalise q and k (float32), scale q by dk^-0.5, repeat key heads to value heads; all [B, Hv, T, .]."""
    r = v.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5

    def l2(x):
        x = x.astype(jnp.float32)
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    q = jnp.repeat(l2(q) * scale, r, axis=2)
    k = jnp.repeat(l2(k), r, axis=2)
    tr = lambda x: jnp.swapaxes(x, 1, 2)
    return tr(q), tr(k), tr(v.astype(jnp.float32)), tr(g.astype(jnp.float32)), tr(beta.astype(jnp.float32))


def gdn_recurrent(q, k, v, g, beta, state, keep_states: bool = False):
    """One token at a time: S = e^g S; S += k (beta (v - kᵀS)); o = qᵀS. Returns (o [B, T, Hv, dv], state), and
    with `keep_states` also the state after each token, [B, T, Hv, dk, dv] (speculative verification's checkpoints:
    the same steps, their states kept)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, T, .]

    def step(S, xs):  # S: [B, Hv, dk, dv]
        q_t, k_t, v_t, g_t, b_t = xs
        S = S * jnp.exp(g_t)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * (v_t - kv))
        o = jnp.einsum("bhkv,bhk->bhv", S, q_t)
        return S, ((o, S) if keep_states else o)

    time_major = lambda x: jnp.moveaxis(x, 2, 0)
    S, ys = jax.lax.scan(step, state.astype(jnp.float32), tuple(map(time_major, (q, k, v, g, beta))))
    if keep_states:
        return jnp.moveaxis(ys[0], 0, 1), S, jnp.moveaxis(ys[1], 0, 1)
    return jnp.moveaxis(ys, 0, 1), S  # o: [B, T, Hv, dv]


def _chunk_terms(q, k, v, g, beta, C: int):
    """Per-chunk WY/UT terms for [B, Hv, T, .] inputs (T a multiple of C); every chunk independent.

    Returns (U, W, P, q_dec, k_dec, last), each [B, Hv, n, ...]: see `gdn_chunked`.
    """
    n = q.shape[2] // C
    chunk = lambda x: x.reshape(x.shape[0], x.shape[1], n, C, *x.shape[3:])
    q, k, v, g, beta = map(chunk, (q, k, v, g, beta))  # [B, Hv, n, C, .]
    G = jnp.cumsum(g, axis=-1)  # [B, Hv, n, C]
    lower = jnp.tril(jnp.ones((C, C), bool))
    gamma = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))  # [B, Hv, n, C, C]
    kb = k * beta[..., None]
    A = jnp.einsum("...ik,...jk->...ij", kb, k) * gamma * jnp.tril(jnp.ones((C, C)), -1)
    # (I + A)^-1 by block doubling (matmuls), not a LAPACK triangular solve: jaxlib's CPU solver runs on a
    # thread pool that deadlocks when several solves (layers, or 8 simulated devices) run at once on 2 cores.
    dv = v.shape[-1]
    UW = jnp.einsum("...ij,...jd->...id", unit_lower_inverse(A),
                    jnp.concatenate([v * beta[..., None], kb * jnp.exp(G)[..., None]], -1),
                    precision="highest")
    U, W = UW[..., :dv], UW[..., dv:]  # [B, Hv, n, C, dv], [B, Hv, n, C, dk]
    P = jnp.einsum("...ik,...jk->...ij", q, k) * gamma  # [B, Hv, n, C, C]
    q_dec = q * jnp.exp(G)[..., None]
    k_dec = k * jnp.exp(G[..., -1:] - G)[..., None]
    return U, W, P, q_dec, k_dec, jnp.exp(G[..., -1])


def unit_lower_inverse(A: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower triangular A [..., C, C], C a power of two, by block doubling on the blocks.

    1. X = the 1x1 diagonal blocks of (I + A)^-1 (ones): [..., C, 1, 1];
    2. for b = 1, 2, 4, ... C/2: X holds the inverses of M = I + A's C/b diagonal b-blocks; pair them up: each
       2b-block of M is [[P, 0], [R, Q]] and its inverse [[P^-1, 0], [-Q^-1 R P^-1, Q^-1]], so the new blocks
       take two b x b x b matmuls each (`_block_matmul`), nothing else.
    The same block formula as doubling on whole [C, C] matrices (X - X M_off X, `gdn.pallas.unit_lower_inverse`,
    the MXU form), without its multiplications by zero blocks: C^3 / 3 multiply-adds in all instead of
    2 C^3 log2 C (measured on XLA:CPU, [8, 8, 8, 64, 64], interleaved, load ~8 on 2 cores: 120 -> 14 CPU-ms
    median). No intermediate outgrows the inverse's own blocks, so float32 stays accurate.
    """
    C = A.shape[-1]
    assert C & (C - 1) == 0, f"chunk size {C} must be a power of two"
    lead = A.shape[:-2]
    X = jnp.ones(lead + (C, 1, 1), A.dtype)
    b = 1
    while b < C:
        m = C // (2 * b)
        diag = jnp.diagonal(A.reshape(lead + (m, 2 * b, m, 2 * b)), axis1=-4, axis2=-2)  # [..., 2b, 2b, m]
        R = jnp.moveaxis(diag[..., b:, :b, :], -1, -3)  # [..., m, b, b]: each 2b-block's lower-left block
        P, Q = X[..., 0::2, :, :], X[..., 1::2, :, :]  # [..., m, b, b]
        Y = -_block_matmul(_block_matmul(Q, R), P)
        X = jnp.concatenate([jnp.concatenate([P, jnp.zeros_like(P)], -1), jnp.concatenate([Y, Q], -1)], -2)
        b *= 2
    return X[..., 0, :, :]


def _block_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """[..., i, j] @ [..., j, k]: below 8 a broadcast multiply-and-sum (one fusion: XLA:CPU runs tiny batched dots
    one small GEMM at a time), a batched matmul from 8 on."""
    if a.shape[-1] < 8:
        return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return jnp.einsum("...ij,...jk->...ik", a, b, precision="highest")


def _chunk_step(S, U_c, W_c, P_c, q_c, k_c, l_c):
    """One chunk of the inter-chunk scan. S: [..., dk, dv]; chunk terms [..., C, .]. Returns (S', o [..., C, dv])."""
    v_new = U_c - jnp.einsum("...ck,...kv->...cv", W_c, S)
    o = jnp.einsum("...ck,...kv->...cv", q_c, S) + jnp.einsum("...cj,...jv->...cv", P_c, v_new)
    return S * l_c[..., None, None] + jnp.einsum("...ck,...cv->...kv", k_c, v_new), o


def gdn_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """The chunked (WY/UT) form: parallel inside chunks of C tokens, a scan over chunks.

    Per chunk, with G = cumsum(g) and Γ_ij = exp(G_i - G_j) for i >= j:
    1. A = strict_tril((beta k) kᵀ ⊙ Γ); U = (I + A)⁻¹ (beta v); W = (I + A)⁻¹ (beta e^G k)
    2. P = tril((q kᵀ) ⊙ Γ) (diagonal included)
    3. scan: V' = U - W S;  O = (e^G q) S + P V';  S = e^G_last S + (e^(G_last - G) k)ᵀ V'
    The tail is padded with g = beta = 0 tokens, which leave the state unchanged.
    """
    B, T = q.shape[:2]
    C = chunk_size
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, T, .]
    pad = -T % C
    padt = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    terms = _chunk_terms(*map(padt, (q, k, v, g, beta)), C)  # each [B, Hv, n, ...]
    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
    S, o = jax.lax.scan(lambda S, xs: _chunk_step(S, *xs), state.astype(jnp.float32),
                        tuple(map(chunk_major, terms)))  # o: [n, B, Hv, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, o.shape[2], -1, o.shape[-1])[:, :, :T]  # [B, Hv, T, dv]
    return jnp.swapaxes(o, 1, 2), S


def gdn_xla(q, k, v, g, beta, state, chunk_size: int = 64):
    """The recurrent form for single-token steps, the chunked form otherwise. Output o in v's dtype."""
    if q.shape[1] == 1:
        o, S = gdn_recurrent(q, k, v, g, beta, state)
    else:
        o, S = gdn_chunked(q, k, v, g, beta, state, chunk_size)
    return o.astype(v.dtype), S


def gdn_ragged_xla(q, k, v, g, beta, states, meta, chunk_size: int = 64, decode=None, prefill=None,
                   checkpoints=None, verify=None):
    """The delta rule over one rank's flat ragged tokens, with per-sequence state slots.

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g, beta: [T, Hv] (0 at padding); states: [NS, Hv, dk, dv] (slot 0: null).
    `meta` (a RaggedMeta) lays the tokens out as [decode region | prefill region]:
    - tokens [0, D) are single decode tokens, token i of sequence i (i < num_decode): the recurrent form,
      vectorised over sequences, reading and writing their slots;
    - tokens [D, T) hold the other sequences' chunks, each starting at a multiple of C (so a C-chunk never
      spans two sequences): the chunked form, as one scan over all chunks whose state is reloaded from the
      slot (or zeroed, for a sequence's first step) at each sequence's first chunk, and stored after its last.
    `decode` (default `gdn_decode_xla`) runs the decode region and `prefill` the prefill region: another
    implementation of their protocols (`gdn.native`'s handlers) replaces either. `prefill(q, k, v, g, beta, first,
    length, slot, start, states, fallback)` takes the region's tokens and, per sequence, its tokens [first,
    first + length) of the region (length 0: not in it), slot and start (False: a zero state); `fallback` (the
    chunked form here, same arguments) runs where it cannot.
    `checkpoints` [NS, V, Hv, dk, dv] (speculative verification, V = k + 1 > 1): the decode region holds V tokens a
    row (`engine.batch.pack(..., width=V)`; a row's padding tokens have g = beta = 0 and leave its state as it was),
    run by `verify` (default `gdn_verify_xla`, the recurrent form; its protocol's other implementation:
    `gdn.native`'s handler), and the state after each of its V tokens is written to its slot's V checkpoints, from
    which the engine keeps the accepted one.
    Returns (o [T, Hv, dv] in v's dtype, states), and the checkpoints when given.
    """
    C = chunk_size
    D = meta.decode_seq.shape[0]
    N = D if checkpoints is None else D * checkpoints.shape[1]  # the decode region's tokens
    T = q.shape[0]
    fresh = meta.kv_len == meta.q_len  # [S]: no context before this step -> zero state

    # 1. decode region: one recurrent step per sequence (V when verifying drafts)
    dseq = meta.decode_seq  # [D], -1 for padding
    dslot = jnp.where(dseq >= 0, meta.slot[jnp.clip(dseq, 0)], -1)  # [D], -1: padding
    start = (dseq >= 0) & ~fresh[jnp.clip(dseq, 0)]  # [D]: continues from its slot (else from zero)
    if checkpoints is None:
        o_dec, states = (decode or gdn_decode_xla)(*(x[:D] for x in (q, k, v, g, beta)), dslot, start, states)
    else:
        o_dec, states, checkpoints = (verify or gdn_verify_xla)(*(x[:N] for x in (q, k, v, g, beta)), dslot, start,
                                                                states, checkpoints)
    done = lambda o, states: (o, states) if checkpoints is None else (o, states, checkpoints)
    if T == N:
        return done(o_dec.astype(v.dtype), states)

    # 2. prefill region: chunks aligned to sequences
    region = meta.q_start >= N  # [S]: the sequences of the prefill region (unused ones have length 0)
    seqs = (meta.q_start - N, jnp.where(region, meta.q_len, 0), meta.slot, ~fresh)

    def chunked(q, k, v, g, beta, first, length, slot, start, states):  # the XLA form: chunks, with meta's layout
        return _prefill_chunked(q, k, v, g, beta, states, meta, fresh, N, C)

    o_pre, states = (prefill or (lambda *a, fallback: fallback(*a)))(
        *(x[N:] for x in (q, k, v, g, beta)), *seqs, states, fallback=chunked)
    return done(jnp.concatenate([o_dec.astype(o_pre.dtype), o_pre]).astype(v.dtype), states)


def _prefill_chunked(q, k, v, g, beta, states, meta, fresh, D: int, C: int):
    """The prefill region [T-D, ...] of `gdn_ragged_xla` in the chunked form: one scan over all its C-chunks, the
    state reloaded at each sequence's first chunk (zero where `fresh` [S]) and stored to its slot after its last.
    Returns (o [T-D, Hv, dv] float32, states)."""

    def seq_state(seq):  # state a sequence starts from: [..., Hv, dk, dv], float32
        s = jnp.clip(seq, 0)  # the slots gathered, then converted: not the whole pool (issue 30)
        return jnp.where((fresh[s] | (seq < 0))[..., None, None, None], 0.0,
                         states[meta.slot[s]].astype(jnp.float32))

    n = q.shape[0] // C
    pq, pk, pv, pg, pb = _prepare(*(x[None] for x in (q, k, v, g, beta)))  # [1, Hv, T-D, .]
    terms = [jnp.moveaxis(t[0], 1, 0) for t in _chunk_terms(pq, pk, pv, pg, pb, C)]  # each [n, Hv, ...]
    first_tok = D + jnp.arange(n) * C
    cseq = meta.token_seq[first_tok]  # [n] sequence of each chunk, -1 for padding chunks
    cs = jnp.clip(cseq, 0)
    is_first = (cseq >= 0) & (first_tok == meta.q_start[cs])
    last_tok = meta.q_start[cs] + meta.q_len[cs] - 1
    is_last = (cseq >= 0) & (last_tok >= first_tok) & (last_tok < first_tok + C)
    start_state = seq_state(cseq)  # [n, Hv, dk, dv]

    def step(S, xs):
        first, S0, *chunk = xs
        S, o = _chunk_step(jnp.where(first, S0, S), *chunk)
        return S, (S, o)

    _, (S_after, o_pre) = jax.lax.scan(step, jnp.zeros_like(start_state[0]), (is_first, start_state, *terms))
    pslot = jnp.where(is_last, meta.slot[cs], 0)
    states = states.at[pslot].set(S_after.astype(states.dtype))
    Hv, dv = o_pre.shape[1], o_pre.shape[3]
    return jnp.swapaxes(o_pre, 1, 2).reshape(n * C, Hv, dv), states  # [n, Hv, C, dv] -> [T-D, Hv, dv]


def _row_states(slot, start, states):
    """The state each decode row starts from [D, Hv, dk, dv] float32: its slot's, or zeros (a fresh or padding row)."""
    return jnp.where((start & (slot >= 0))[:, None, None, None], states[jnp.maximum(slot, 0)].astype(jnp.float32),
                     0.0)


def gdn_verify_xla(q, k, v, g, beta, slot, start, states, checkpoints):
    """`gdn_decode_xla` over V tokens a row (speculative verification): q, k [D V, Hk, dk]; v [D V, Hv, dv]; g, beta
    [D V, Hv], row i's tokens at [i V, i V + V); slot, start [D] as there; checkpoints [NS, V, Hv, dk, dv].
    1. each row's V tokens through the recurrent form from its slot's state, keeping the state after each;
    2. the last one into its slot, all V into its slot's checkpoints (a padding row: the null slot's).
    Returns (o [D V, Hv, dv] float32, states, checkpoints)."""
    D, V = slot.shape[0], checkpoints.shape[1]
    rows = lambda x: x.reshape(D, V, *x.shape[1:])
    o, S, kept = gdn_recurrent(*map(rows, (q, k, v, g, beta)), _row_states(slot, start, states), keep_states=True)
    at = jnp.maximum(slot, 0)
    return (o.reshape(D * V, *o.shape[2:]), states.at[at].set(S.astype(states.dtype)),
            checkpoints.at[at].set(kept.astype(checkpoints.dtype)))


def gdn_decode_xla(q, k, v, g, beta, slot, start, states):
    """One recurrent step per row from its state slot: the decode region of `gdn_ragged_xla`.

    q, k [D, Hk, dk]; v [D, Hv, dv]; g, beta [D, Hv]; slot [D] (-1: a padding row, written to the null slot 0);
    start [D] bool (False, or a padding row: starts from a zero state); states [NS, Hv, dk, dv].
    Returns (o [D, Hv, dv] float32, states with each row's new state in its slot).
    """
    S0 = _row_states(slot, start, states)
    o, S = gdn_recurrent(*(x[:, None] for x in (q, k, v, g, beta)), S0)  # [D, 1, Hv, dv], [D, Hv, dk, dv]
    return o[:, 0], states.at[jnp.maximum(slot, 0)].set(S.astype(states.dtype))


register("gdn", "xla")(GdnKernels(dense=gdn_xla, ragged=gdn_ragged_xla))
