"""Batched ragged paged attention and the KV-cache write as Pallas TPU kernels (slot `attention`, name "pallas").

The reference twins are in `attention/xla.py`; the protocol is the same (see `registry.AttentionKernels`).
On a backend other than TPU the kernels run in Pallas interpret mode (numerics only, slow). The slot's `dense`
entry (full-sequence attention over right-padded rows, not the serving path) stays the XLA one.

The attention kernel's unit of work is an *item*: one run of consecutive flat tokens that belong to the same
sequence and the same query block of `block_q` tokens. A decode token is an item of its own; a prefill chunk of
L tokens is about L / block_q items. Items are derived from `token_seq` on the device (`_work_items`), so the
caller's metadata is unchanged. The grid walks the items in token order; each item streams only its sequence's
pages up to the last one its tokens can see (double-buffered DMAs from HBM, page ids scalar-prefetched into SMEM)
and keeps a running softmax for its block's rows. All KV heads are done in one item: a page holds every head's K
and V contiguously (`engine/cache.py`), so one DMA per page fetches what the whole block needs.

The write, separate and fused. The slot protocol (`model/attention.py`) writes the step's K/V and then attends
over the pages, per rank under `vmap`. `write_kv_pages_pallas` is that write as its own kernel: aliased and in
place, a read-modify-write of the 8-row tiles the new tokens land in (Mosaic DMAs start at tile boundaries).
`paged_attention_write_pallas` (the slot's optional `paged_write`, which the model prefers) fuses it into the
attention: ONE pallas_call over the attention items whose grid step 0 first does every tile's read-modify-write
and waits on the DMAs back, so a token's own K/V is in the pool before any item reads its page (the grid is
sequential, "arbitrary"); the items then read the pages from the aliased output (the pool as written: in the HLO
interpreter the input and output are distinct buffers). This saves a launch; the tiles moved are the same. FP8
scales are still stored by an XLA scatter before the call. Both share their preparation (`_write_setup`,
`_attention_setup`) and kernel bodies (`_merge_tiles`, `_attention_kernel`) with the separate kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35_lib.kernels.attention.xla import attention_xla
from qwen35_lib.kernels.registry import AttentionKernels, pallas_interpret, register
from qwen35_lib.weights import FP8_MAX

NEG = -1e30  # finite mask value: exp(NEG - NEG) = 1 keeps untouched rows' running state exact (no inf - inf)


def _interpret() -> bool:
    return pallas_interpret()


def _work_items(token_seq, positions, block_q: int, page_size: int, num_items: int):
    """Items (runs of one sequence's tokens inside one query block) from the flat batch metadata.

    token_seq, positions: [Tp] (Tp a multiple of block_q, -1 = padding). Returns int32 arrays [num_items]:
    block (query block), seq, lo, hi (the run's flat token range [lo, hi)), pages (pages the run reads: up to its
    highest position; 0 for an unused item), first / last (1 where the item opens / closes its query block), and
    the number of runs (a run count above num_items makes the caller return NaN rather than a silent error).
    1. a run starts at a valid token whose predecessor is another sequence or in another block
    2. scatter each valid token into its run's slot: min token, max token + 1, max position
    3. unused items repeat the last real item's block, so their grid steps move no data
    """
    Tp = token_seq.shape[0]
    t = jnp.arange(Tp, dtype=jnp.int32)
    valid = token_seq >= 0
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), token_seq[:-1]])
    start = valid & ((t % block_q == 0) | (token_seq != prev))  # [Tp]
    n_runs = jnp.sum(start, dtype=jnp.int32)
    run = jnp.where(valid, jnp.cumsum(start, dtype=jnp.int32) - 1, num_items)  # [Tp]; num_items = dropped
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.full((num_items,), big, jnp.int32).at[run].min(t, mode="drop")
    hi = jnp.zeros((num_items,), jnp.int32).at[run].max(t + 1, mode="drop")
    seq = jnp.zeros((num_items,), jnp.int32).at[run].max(token_seq, mode="drop")
    max_pos = jnp.full((num_items,), -1, jnp.int32).at[run].max(positions, mode="drop")
    used = jnp.arange(num_items) < n_runs
    pages = jnp.where(used, max_pos // page_size + 1, 0)
    block = jnp.where(used, lo // block_q, 0)
    last_real = jnp.maximum(jnp.minimum(n_runs, num_items) - 1, 0)
    block = jnp.where(used, block, block[last_real])
    lo, hi, seq = (jnp.where(used, a, 0) for a in (lo, hi, seq))
    prev_block = jnp.concatenate([jnp.full((1,), -1, jnp.int32), block[:-1]])
    next_block = jnp.concatenate([block[1:], jnp.full((1,), -1, jnp.int32)])
    first = (used & (block != prev_block)).astype(jnp.int32)
    last = (used & ((block != next_block) | (jnp.arange(num_items) == last_real))).astype(jnp.int32)
    return block, seq, lo, hi, pages, first, last, n_runs


def _softmax_step(h: int, q_ref, kv, mask, key_in, scale_rows, m_ref, l_ref, acc_ref, head_dim: int) -> None:
    """KV head h's online-softmax update over one step's keys (`_attention_kernel`, step 2): kv [K, 2*Hkv*d] (K of
    head h in lanes [2h*d, (2h+1)*d), V in the next d), mask [R, K], key_in [K, 1] (keys on fetched pages);
    `scale_rows(r)` [1, K] the FP8 scale rows (None: not FP8)."""
    d = q_ref.shape[-1]
    fp8 = scale_rows is not None
    k = kv[:, 2 * h * d:(2 * h + 1) * d]  # [K, d]
    v = kv[:, (2 * h + 1) * d:(2 * h + 2) * d]
    q = q_ref[h]  # [R, d]
    if fp8:
        k, q = k.astype(jnp.float32), q.astype(jnp.float32)
    v = jnp.where(key_in, v.astype(jnp.float32), 0.0)  # pages not fetched hold stale VMEM
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if fp8:
        s = s * scale_rows(2 * h)  # [R, K] * [1, K]: K of key t dequantized by its scale
    s = jnp.where(mask, s * head_dim**-0.5, NEG)  # [R, K] (stale keys' NaN masked away)
    m_prev = m_ref[h]  # [R, 1]
    m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)  # [R, K]
    alpha = jnp.exp(m_prev - m_new)
    l_ref[h] = alpha * l_ref[h] + p.sum(axis=-1, keepdims=True)
    pv = p
    if fp8:  # V of key t dequantized by its scale; masked so a stale scale cannot make 0 * inf
        pv = jnp.where(mask, p * scale_rows(2 * h + 1), 0.0)
    acc_ref[h] = alpha * acc_ref[h] + jnp.dot(pv, v, preferred_element_type=jnp.float32)
    m_ref[h] = m_new


def _kernel_refs(rest: tuple, fp8: bool) -> tuple:
    """`_attention_kernel`'s refs after the inputs: (sc_hbm, o_ref, kvbuf, scbuf, sem, m, l, acc); the scale refs
    None when not FP8."""
    if fp8:
        return rest
    o_ref, kvbuf, sem, m_ref, l_ref, acc_ref = rest
    return None, o_ref, kvbuf, None, sem, m_ref, l_ref, acc_ref


def _attention_kernel(blk_ref, seq_ref, lo_ref, hi_ref, np_ref, first_ref, last_ref, pt_ref,  # SMEM [W] / [S*n]
                      q_ref, pos_ref, kv_hbm, *rest, block_q: int, group: int, head_dim: int, page_size: int,
                      pages_per_step: int, max_pages: int, fp8: bool):
    """One grid step = one item (see `_work_items`); refs:

    q_ref [Hkv, R, d] with R = block_q * G rows (row r = token r // G of the block, query head r % G of the group);
    pos_ref [R, 1] int32 (each row's position); kv_hbm [P, ps, 2*Hkv*d] in HBM (K of head h in lanes
    [2h*d, (2h+1)*d), V in the next d); sc_hbm [P, 2*Hkv, ps] f32 (FP8 only: token-minor, row 2h the K scales
    of head h, 2h + 1 its V scales); o_ref [Hkv, R, d]; scratch: kvbuf [2, pps*ps, 2*Hkv*d] (+ scbuf
    [2, pps, 2*Hkv, ps]: one DMA'd page each), DMA semaphores [2], m, l [Hkv, R, 1],
    acc [Hkv, R, d] f32.
    1. on the block's first item, zero the running softmax state (m = NEG, l = 0, acc = 0)
    2. loop over steps of pps pages: wait for this step's pages, start the next step's DMAs, then for each KV head:
       s = q kᵀ / sqrt(d) masked to (row in this run) & (key position <= row position); online softmax update.
       FP8: the scales stay on the key (lane) axis: s = (q kᵀ) * scale_k[key] and acc += (p * scale_v[key]) v,
       the same sums as dequantizing K and V rows first (a [1, K] row per head, no transpose)
    3. on the block's last item, write o = acc / l (0 for rows no item touched: padding)
    """
    sc_hbm, o_ref, kvbuf, scbuf, sem, m_ref, l_ref, acc_ref = _kernel_refs(rest, fp8)
    i = pl.program_id(0)
    Hkv, R, d = q_ref.shape
    ps, pps = page_size, pages_per_step
    n_pages = np_ref[i]
    seq = seq_ref[i]

    @pl.when(first_ref[i] == 1)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def copies(step, slot):
        """The DMAs of pages [step*pps, step*pps + pps) ∩ [0, n_pages), as (condition, descriptors)."""
        out = []
        for k in range(pps):
            j = step * pps + k
            page = pt_ref[seq * max_pages + jnp.minimum(j, max_pages - 1)]
            descs = [pltpu.make_async_copy(kv_hbm.at[page], kvbuf.at[slot, pl.ds(k * ps, ps)], sem.at[slot])]
            if fp8:
                descs.append(pltpu.make_async_copy(sc_hbm.at[page], scbuf.at[slot, k], sem.at[slot]))
            out.append((j < n_pages, descs))
        return out

    def run(step, slot, method):
        for cond, descs in copies(step, slot):
            @pl.when(cond)
            def _go(descs=descs):
                for desc in descs:
                    getattr(desc, method)()

    @pl.when(n_pages > 0)
    def _attend():
        n_steps = jax.lax.div(n_pages + pps - 1, pps)  # lax.div/rem: non-negative ints, no sign op
        run(0, 0, "start")
        row_tok = blk_ref[i] * block_q + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0), group)  # [R, 1]
        row_ok = (row_tok >= lo_ref[i]) & (row_tok < hi_ref[i])  # [R, 1]
        row_pos = pos_ref[...]  # [R, 1]

        def body(step, carry):
            slot = jax.lax.rem(step, 2)
            run(step, slot, "wait")

            @pl.when(step + 1 < n_steps)
            def _prefetch():
                run(step + 1, 1 - slot, "start")

            kv = kvbuf[slot]  # [pps*ps, 2*Hkv*d]
            key_pos = step * pps * ps + jax.lax.broadcasted_iota(jnp.int32, (1, pps * ps), 1)  # [1, K]
            mask = row_ok & (key_pos <= row_pos)  # [R, K]
            key_in = step * pps * ps + jax.lax.broadcasted_iota(jnp.int32, (pps * ps, 1), 0) < n_pages * ps  # [K, 1]
            sc = scbuf[slot] if fp8 else None  # [pps, 2*Hkv, ps]

            def rows(r):
                """[1, K]: scale row r (2h: K, 2h + 1: V of head h) of the step's pages in turn."""
                return sc[0, r:r + 1] if pps == 1 else jnp.concatenate([sc[j, r:r + 1] for j in range(pps)], axis=1)

            for h in range(Hkv):
                _softmax_step(h, q_ref, kv, mask, key_in, rows if fp8 else None, m_ref, l_ref, acc_ref, head_dim)
            return carry

        jax.lax.fori_loop(0, n_steps, body, 0)

    @pl.when(last_ref[i] == 1)
    def _finish():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _attention_setup(q, kv_pages, kv_scales, page_table, token_seq, positions, block_q: int,
                     pages_per_step: int | None):
    """What a pallas_call over the attention items needs (steps 1-2 of `paged_attention_pallas`).

    Returns (scalars: the 8 scalar-prefetch arrays, blocked: [qt, row_pos] and their BlockSpecs, q_spec (also the
    output's), scratch (the attention's VMEM / semaphores, the FP8 scale buffer included), kernel keywords for
    `_attention_kernel`, W (items = grid steps), finish: out [Hkv, Tp*G, d] -> o [T, Hq, d]).
    """
    T, Hq, d = q.shape
    P, ps, H2d = kv_pages.shape
    Hkv = H2d // (2 * d)
    G = Hq // Hkv
    S, n = page_table.shape
    fp8 = kv_scales is not None
    pps = pages_per_step or max(1, min(n, 128 // ps))
    Tp = -(-T // block_q) * block_q
    nb, R = Tp // block_q, block_q * G
    W = nb + S  # items: every block once, plus one extra per sequence boundary

    token_seq = jnp.pad(token_seq.astype(jnp.int32), (0, Tp - T), constant_values=-1)
    positions = jnp.pad(positions.astype(jnp.int32), (0, Tp - T))
    qt = jnp.pad(q, ((0, Tp - T), (0, 0), (0, 0))).reshape(Tp, Hkv, G, d).transpose(1, 0, 2, 3)
    qt = qt.reshape(Hkv, Tp * G, d)  # [Hkv, Tp*G, d]
    row_pos = jnp.repeat(positions, G)[:, None]  # [Tp*G, 1]
    block, seq, lo, hi, pages, first, last, n_runs = _work_items(token_seq, positions, block_q, ps, W)
    scalars = [block, seq, lo, hi, pages, first, last, page_table.astype(jnp.int32).reshape(-1)]

    q_spec = pl.BlockSpec((Hkv, R, d), lambda i, blk, *_: (0, blk[i], 0))
    specs = [q_spec, pl.BlockSpec((R, 1), lambda i, blk, *_: (blk[i], 0))]
    scratch = [pltpu.VMEM((2, pps * ps, H2d), kv_pages.dtype)]
    if fp8:
        scratch.append(pltpu.VMEM((2, pps, 2 * Hkv, ps), jnp.float32))
    scratch += [pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((Hkv, R, 1), jnp.float32),
                pltpu.VMEM((Hkv, R, 1), jnp.float32), pltpu.VMEM((Hkv, R, d), jnp.float32)]
    kw = dict(block_q=block_q, group=G, head_dim=d, page_size=ps, pages_per_step=pps, max_pages=n, fp8=fp8)

    def finish(out):
        o = out.reshape(Hkv, Tp, G, d).transpose(1, 0, 2, 3).reshape(Tp, Hq, d)[:T]
        o = jnp.where((token_seq[:T] >= 0)[:, None, None], o, 0)
        return jnp.where(n_runs > W, jnp.nan, o).astype(q.dtype)

    return scalars, ([qt, row_pos], specs), q_spec, scratch, kw, W, finish


def _attention_cost(q, kv_pages, page_table) -> pl.CostEstimate:
    """A static estimate for the attention calls: the pages actually attended are data dependent, so every token
    is counted against a full page table row (n * ps keys): q kᵀ and p v, 2 FLOPs per multiply-add each, and one
    exp per score."""
    T, Hq, d = q.shape
    keys = page_table.shape[1] * kv_pages.shape[1]
    # bytes 0: XLA's cost analysis already counts a custom call's operand and result bytes, and adds these
    return pl.CostEstimate(flops=4 * T * Hq * d * keys, transcendentals=T * Hq * keys, bytes_accessed=0)


@functools.partial(jax.jit, static_argnames=("block_q", "pages_per_step", "interpret"))
def paged_attention_pallas(q, kv_pages, kv_scales, page_table, token_seq, positions, *, block_q: int = 16,
                           pages_per_step: int | None = None, interpret: bool | None = None):
    """Attention of flat ragged tokens over the paged KV cache, one Pallas call; the XLA twin's protocol.

    q: [T, Hq, d]; kv_pages: [P, ps, 2*Hkv*d] bf16/f32 or FP8 (then kv_scales [P, 2*Hkv, ps] f32, else None);
    page_table: [S, n]; token_seq, positions: [T]. Returns o: [T, Hq, d] (0 for padding tokens).
    Precondition (the engine's `RaggedMeta` meets it): a sequence's tokens are contiguous in the flat batch, so
    there are at most T / block_q + S runs; otherwise the result is NaN.
    1. pad T to a multiple of block_q; queries to KV-head-major rows: [Hkv, T*G, d] (row = token * G + g)
    2. derive the items (runs of one sequence inside a query block) and their page counts
    3. one pallas_call over the items (`_attention_kernel`), reading the pool in place; back to [T, Hq, d],
       padding rows zeroed.
    """
    interpret = _interpret() if interpret is None else interpret
    scalars, (blocked, specs), q_spec, scratch, kw, W, finish = _attention_setup(
        q, kv_pages, kv_scales, page_table, token_seq, positions, block_q, pages_per_step)
    pools = [kv_pages] + ([kv_scales.astype(jnp.float32)] if kv_scales is not None else [])
    any_specs = [pl.BlockSpec(memory_space=pl.ANY)] * len(pools)
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(scalars), grid=(W,), in_specs=specs + any_specs,
                                             out_specs=q_spec, scratch_shapes=scratch)
    out = pl.pallas_call(
        functools.partial(_attention_kernel, **kw), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(blocked[0].shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)), interpret=interpret,
        cost_estimate=_attention_cost(q, kv_pages, page_table), name="ragged_paged_attention",
    )(*scalars, *blocked, *pools)
    return finish(out)


def _merge_tiles(b, page_ref, tile_ref, rows_ref, new_ref, kv_out, buf, sem, *, block_t: int, tile: int):
    """Merge the new rows of the groups in token block `b` into their cache tiles in HBM, read-modify-write.

    A group is a run of tokens writing one tile (`tile` rows of one page; DMAs must start at a tile boundary on
    TPU, so a single row cannot be copied alone). SMEM [Tp]: page_ref (the page of the group starting at this
    token, -1 elsewhere and for padding), tile_ref (the tile's first row in its page), rows_ref (bit r set: the
    group writes row r of the tile); new_ref [bt, tile, 2*Hkv*d] in VMEM (slot j: the new rows of the group
    starting at token b*bt + j); kv_out [P, ps, 2*Hkv*d] in HBM, indexed by (page, rows): nothing reshaped;
    buf [bt, tile, 2*Hkv*d].
    1. DMA in the tile of every group of this block; 2. keep its old rows but the group's new ones;
    3. DMA the tiles back, then wait for them all (so a later read of the pool sees them).
    """
    def desc(j, into):
        t = b * block_t + j
        hbm = kv_out.at[jnp.maximum(page_ref[t], 0), pl.ds(pl.multiple_of(tile_ref[t], tile), tile)]
        src, dst = (hbm, buf.at[j]) if into else (buf.at[j], hbm)
        return pltpu.make_async_copy(src, dst, sem.at[0])

    def each(fn):
        def body(j, carry):
            @pl.when(page_ref[b * block_t + j] >= 0)
            def _go():
                fn(j)
            return carry

        jax.lax.fori_loop(0, block_t, body, 0)

    def merge(j):
        bits = rows_ref[b * block_t + j]
        row = jax.lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
        keep_new = jax.lax.shift_right_logical(jnp.full((tile, 1), bits, jnp.int32), row) & 1 == 1  # [tile, 1]
        buf[j] = jnp.where(keep_new, new_ref[j], buf[j])

    each(lambda j: desc(j, True).start())
    each(lambda j: desc(j, True).wait())
    each(merge)
    each(lambda j: desc(j, False).start())
    each(lambda j: desc(j, False).wait())


def _write_kernel(page_ref, tile_ref, rows_ref, new_ref, kv_in, kv_out, buf, sem, *, block_t: int, tile: int):
    """One grid step = one block of bt tokens: `_merge_tiles` (kv_out aliases kv_in; new_ref is this block's)."""
    del kv_in
    _merge_tiles(pl.program_id(0), page_ref, tile_ref, rows_ref, new_ref, kv_out, buf, sem, block_t=block_t,
                 tile=tile)


def _write_setup(kv_pages, kv_scales, k, v, page, offset, block_t: int):
    """Steps 1-2 of `write_kv_pages_pallas`. Returns (kv_scales (updated for FP8), scalars: [page_ref, tile_ref,
    rows_ref] [Tp], new [Tp, tile, 2*Hkv*d], bt, tile)."""
    T, Hkv, d = k.shape
    ps = kv_pages.shape[1]
    tr = 8 if ps % 8 == 0 else ps
    if tr > 32:
        raise ValueError(f"page_size {ps}: the Pallas KV write needs a multiple of 8 or at most 32 (row bit masks)")
    kv = jnp.stack([k, v], axis=2).reshape(T, 2 * Hkv, d)  # [T, 2*Hkv, d]
    if kv_scales is not None:
        kv32 = kv.astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(kv32), axis=-1), 1e-12) / FP8_MAX  # [T, 2*Hkv]
        kv = kv32 / scale[..., None]
        kv_scales = kv_scales.at[page, :, offset].set(scale)  # [page, 2h + j, offset]: in place, token-minor
    kv = kv.astype(kv_pages.dtype).reshape(T, 2 * Hkv * d)  # [T, 2*Hkv*d]
    bt = min(block_t, T)
    Tp = -(-T // bt) * bt
    t = jnp.arange(Tp, dtype=jnp.int32)
    pg = jnp.pad(jnp.where(page > 0, page, -1).astype(jnp.int32), (0, Tp - T), constant_values=-1)  # [Tp]
    off = jnp.pad(offset.astype(jnp.int32), (0, Tp - T))
    key = jnp.where(pg >= 0, pg * (ps // tr) + off // tr, -1)  # [Tp]: the tile a token writes
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), key[:-1]])
    start = (pg >= 0) & ((t % bt == 0) | (key != prev))
    group = jax.lax.cummax(jnp.where(start, t, -1))  # [Tp]: the group's first token
    slot = jnp.where(pg >= 0, group, Tp)  # Tp = dropped
    new = jnp.zeros((Tp, tr, 2 * Hkv * d), kv.dtype).at[slot[:T], off[:T] % tr].set(kv, mode="drop")
    rows = jnp.zeros((Tp,), jnp.int32).at[slot].add(jnp.left_shift(1, off % tr), mode="drop")
    return kv_scales, [jnp.where(start, pg, -1), off // tr * tr, rows], new, bt, tr


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def write_kv_pages_pallas(kv_pages, kv_scales, k, v, page, offset, *, block_t: int = 32,
                          interpret: bool | None = None):
    """The KV-cache write of `attention.xla.write_kv_pages`, the rows moved by a Pallas DMA kernel, in place.

    kv_pages [P, ps, 2*Hkv*d]; kv_scales [P, 2*Hkv, ps] | None; k, v [T, Hkv, d]; page, offset [T].
    Precondition (the engine's `RaggedMeta` meets it): tokens writing the same tile of a page are contiguous.
    1. interleave K and V per head -> [T, 2*Hkv*d]; for FP8 quantize with per-(token, head) scales amax / 448
       (elementwise, left to XLA) and store the scales with an XLA scatter (4 bytes per token and head, at
       [page, 2h + j, offset])
    2. group the tokens: a run writing one tile of 8 rows (ps when ps is not a multiple of 8) inside a block of
       bt tokens; place each group's new rows in a [tile, 2*Hkv*d] slot (XLA scatter, a few rows per token)
    3. Pallas: per group one DMA of the tile in, the merge, one DMA back into the aliased cache (page 0 = padding:
       skipped; the null page's contents are never read for a real token). In place when the caller donates it.
    """
    interpret = _interpret() if interpret is None else interpret
    kv_scales, scalars, new, bt, tr = _write_setup(kv_pages, kv_scales, k, v, page, offset, block_t)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(new.shape[0] // bt,),
        in_specs=[pl.BlockSpec((bt,) + new.shape[1:], lambda b, *_: (b, 0, 0)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((bt,) + new.shape[1:], new.dtype), pltpu.SemaphoreType.DMA((1,))])
    out = pl.pallas_call(
        functools.partial(_write_kernel, block_t=bt, tile=tr), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype), input_output_aliases={len(scalars) + 1: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)), interpret=interpret,
        name="kv_cache_write",
    )(*scalars, new, kv_pages)
    return out, kv_scales


def _fused_kernel(*refs, n_attn_scratch: int, n_write_blocks: int, block_t: int, tile: int, fp8: bool, **kw):
    """The KV write, then the attention items, in one grid (`paged_attention_write_pallas`); refs:

    SMEM: the 8 attention scalars (`_attention_kernel`), then the write's page_ref, tile_ref, rows_ref [Tw];
    inputs q_ref, pos_ref (blocked), new_hbm [Tw, tile, 2*Hkv*d], kv_in (aliased by kv_out: unused), sc_hbm (FP8);
    outputs o_ref, kv_out [P, ps, 2*Hkv*d] (HBM); the attention's scratch, then newbuf, buf [bt, tile, 2*Hkv*d],
    wsem.
    1. at grid step 0 only: for each block of bt new tokens, DMA its slots in and `_merge_tiles` them into kv_out,
       waiting on every tile's DMA back before the next block (the grid is sequential, so all writes land before
       any page read below)
    2. every step: the item's attention (`_attention_kernel`) reading the pages from kv_out, the written pool
       (not kv_in: in the HLO interpreter they are distinct buffers)
    """
    attn_smem, (page_ref, tile_ref, rows_ref), rest = refs[:8], refs[8:11], refs[11:]
    q_ref, pos_ref, new_hbm, _kv_in, *rest = rest
    sc = [rest.pop(0)] if fp8 else []
    o_ref, kv_out, *rest = rest
    attn_scratch, (newbuf, buf, wsem) = rest[:n_attn_scratch], rest[n_attn_scratch:]

    @pl.when(pl.program_id(0) == 0)
    def _write():
        def block(b, carry):
            cp = pltpu.make_async_copy(new_hbm.at[pl.ds(pl.multiple_of(b * block_t, block_t), block_t)], newbuf,
                                       wsem.at[0])
            cp.start()
            cp.wait()
            _merge_tiles(b, page_ref, tile_ref, rows_ref, newbuf, kv_out, buf, wsem, block_t=block_t, tile=tile)
            return carry

        jax.lax.fori_loop(0, n_write_blocks, block, 0)

    _attention_kernel(*attn_smem, q_ref, pos_ref, kv_out, *sc, o_ref, *attn_scratch, fp8=fp8, **kw)


@functools.partial(jax.jit, static_argnames=("block_q", "pages_per_step", "block_t", "interpret"))
def paged_attention_write_pallas(q, k, v, kv_pages, kv_scales, page, offset, page_table, token_seq, positions, *,
                                 block_q: int = 16, pages_per_step: int | None = None, block_t: int = 32,
                                 interpret: bool | None = None):
    """`write_kv_pages_pallas` then `paged_attention_pallas` as ONE Pallas call: the slot's `paged_write`.

    q [T, Hq, d]; k, v [T, Hkv, d]; kv_pages, kv_scales, page, offset as the write's; page_table, token_seq,
    positions as the attention's. Returns (o [T, Hq, d], kv_pages, kv_scales), equal bit for bit to the two calls.
    Preconditions: both kernels' (the engine's `RaggedMeta` meets them).
    1. the write's preparation (`_write_setup`: FP8 scales still by an XLA scatter) and the attention's
       (`_attention_setup`)
    2. one pallas_call over the attention items (`_fused_kernel`): grid step 0 first merges every new row into its
       tile of the pool (aliased: in place when the caller donates it), then the items read the pages from it.
    """
    interpret = _interpret() if interpret is None else interpret
    kv_scales, w_scalars, new, bt, tr = _write_setup(kv_pages, kv_scales, k, v, page, offset, block_t)
    scalars, (blocked, specs), q_spec, scratch, kw, W, finish = _attention_setup(
        q, kv_pages, kv_scales, page_table, token_seq, positions, block_q, pages_per_step)
    scalars += w_scalars
    sc = [kv_scales.astype(jnp.float32)] if kv_scales is not None else []
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(W,), in_specs=specs + [hbm, hbm] + [hbm] * len(sc),
        out_specs=[q_spec, hbm],
        scratch_shapes=scratch + [pltpu.VMEM((bt,) + new.shape[1:], new.dtype)] * 2 + [pltpu.SemaphoreType.DMA((1,))])
    kernel = functools.partial(_fused_kernel, n_attn_scratch=len(scratch), n_write_blocks=new.shape[0] // bt,
                               block_t=bt, tile=tr, **kw)
    out_shape = (jax.ShapeDtypeStruct(blocked[0].shape, q.dtype), jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype))
    out, kv_pages = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=out_shape,
        input_output_aliases={len(scalars) + len(blocked) + 1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)), interpret=interpret,
        cost_estimate=_attention_cost(q, kv_pages, page_table), name="ragged_paged_attention_kv_write",
    )(*scalars, *blocked, new, kv_pages, *sc)
    return finish(out), kv_pages, kv_scales


@register("attention", "pallas", per_platform=True)
def _kernels(platform: str) -> AttentionKernels:
    """The slot's kernels compiled for a TPU, or in interpret mode on another platform."""
    interpret = pallas_interpret(platform)
    return AttentionKernels(dense=attention_xla, paged=functools.partial(paged_attention_pallas, interpret=interpret),
                            write=functools.partial(write_kv_pages_pallas, interpret=interpret),
                            paged_write=functools.partial(paged_attention_write_pallas, interpret=interpret))
