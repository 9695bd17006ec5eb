"""Batched ragged paged attention and the KV-cache write as Pallas TPU kernels (slot `attention`, name "pallas").

The reference twins are in `attention_xla.py`; the protocol is the same (see `registry.AttentionKernels`).
On a backend other than TPU both kernels run in Pallas interpret mode (numerics only, slow). The slot's `dense`
entry (full-sequence attention over right-padded rows, not the serving path) stays the XLA one.

The attention kernel's unit of work is an *item*: one run of consecutive flat tokens that belong to the same
sequence and the same query block of `block_q` tokens. A decode token is an item of its own; a prefill chunk of
L tokens is about L / block_q items. Items are derived from `token_seq` on the device (`_work_items`), so the
caller's metadata is unchanged. The grid walks the items in token order; each item streams only its sequence's
pages up to the last one its tokens can see (double-buffered DMAs from HBM, page ids scalar-prefetched into SMEM)
and keeps a running softmax for its block's rows. All KV heads are done in one item: a page holds every head's K
and V contiguously (`engine/cache.py`), so one DMA per page fetches what the whole block needs.

Why the write is a separate kernel, not fused: the slot protocol (and `model/attention.py`, which calls it)
writes the step's K/V first and then attends over the pages, per rank under `vmap`. Fusing the write into the
attention kernel would change that call contract and needs an ordering guarantee (a token's own K/V in the page
before any item reads it) that only holds for the engine's packing; the separate kernel is aliased and in place
(a read-modify-write of the 8-row tiles the new tokens land in: Mosaic DMAs start at tile boundaries), so the extra
cost is one launch and moving those tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35_lib.kernels.attention_xla import FP8_MAX, attention_xla
from qwen35_lib.kernels.registry import AttentionKernels, pallas_interpret, register

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


def _attention_kernel(blk_ref, seq_ref, lo_ref, hi_ref, np_ref, first_ref, last_ref, pt_ref,  # SMEM [W] / [S*n]
                      q_ref, pos_ref, kv_hbm, *rest, block_q: int, group: int, head_dim: int, page_size: int,
                      pages_per_step: int, max_pages: int, fp8: bool):
    """One grid step = one item (see `_work_items`); refs:

    q_ref [Hkv, R, d] with R = block_q * G rows (row r = token r // G of the block, query head r % G of the group);
    pos_ref [R, 1] int32 (each row's position); kv_hbm [P, ps, 2*Hkv*d] in HBM (K of head h in lanes
    [2h*d, (2h+1)*d), V in the next d); sc_hbm [P, ps, 2*Hkv] f32 (FP8 only); o_ref [Hkv, R, d];
    scratch: kvbuf [2, pps*ps, 2*Hkv*d] (+ scbuf [2, pps*ps, 2*Hkv]), DMA semaphores [2], m, l [Hkv, R, 1],
    acc [Hkv, R, d] f32.
    1. on the block's first item, zero the running softmax state (m = NEG, l = 0, acc = 0)
    2. loop over steps of pps pages: wait for this step's pages, start the next step's DMAs, then for each KV head:
       s = q kᵀ / sqrt(d) masked to (row in this run) & (key position <= row position); online softmax update
    3. on the block's last item, write o = acc / l (0 for rows no item touched: padding)
    """
    if fp8:
        sc_hbm, o_ref, kvbuf, scbuf, sem, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, kvbuf, sem, m_ref, l_ref, acc_ref = rest
        sc_hbm = scbuf = None
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
                descs.append(pltpu.make_async_copy(sc_hbm.at[page], scbuf.at[slot, pl.ds(k * ps, ps)], sem.at[slot]))
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
            sc = scbuf[slot] if fp8 else None  # [K, 2*Hkv]
            for h in range(Hkv):
                k = kv[:, 2 * h * d:(2 * h + 1) * d]  # [K, d]
                v = kv[:, (2 * h + 1) * d:(2 * h + 2) * d]
                q = q_ref[h]  # [R, d]
                if fp8:
                    k = k.astype(jnp.float32) * sc[:, 2 * h:2 * h + 1]
                    v = v.astype(jnp.float32) * sc[:, 2 * h + 1:2 * h + 2]
                    q = q.astype(jnp.float32)
                v = jnp.where(key_in, v.astype(jnp.float32), 0.0)  # pages not fetched hold stale VMEM
                s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                s = jnp.where(mask, s * head_dim**-0.5, NEG)  # [R, K]
                m_prev = m_ref[h]  # [R, 1]
                m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s - m_new), 0.0)  # [R, K]
                alpha = jnp.exp(m_prev - m_new)
                l_ref[h] = alpha * l_ref[h] + p.sum(axis=-1, keepdims=True)
                acc_ref[h] = alpha * acc_ref[h] + jnp.dot(p, v, preferred_element_type=jnp.float32)
                m_ref[h] = m_new
            return carry

        jax.lax.fori_loop(0, n_steps, body, 0)

    @pl.when(last_ref[i] == 1)
    def _finish():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "pages_per_step", "interpret"))
def paged_attention_pallas(q, kv_pages, kv_scales, page_table, token_seq, positions, *, block_q: int = 16,
                           pages_per_step: int | None = None, interpret: bool | None = None):
    """Attention of flat ragged tokens over the paged KV cache, one Pallas call; the XLA twin's protocol.

    q: [T, Hq, d]; kv_pages: [P, ps, 2*Hkv*d] bf16/f32 or FP8 (then kv_scales [P, ps, 2*Hkv] f32, else None);
    page_table: [S, n]; token_seq, positions: [T]. Returns o: [T, Hq, d] (0 for padding tokens).
    Precondition (the engine's `RaggedMeta` meets it): a sequence's tokens are contiguous in the flat batch, so
    there are at most T / block_q + S runs; otherwise the result is NaN.
    1. pad T to a multiple of block_q; queries to KV-head-major rows: [Hkv, T*G, d] (row = token * G + g)
    2. derive the items (runs of one sequence inside a query block) and their page counts
    3. one pallas_call over the items (`_attention_kernel`), reading the pool in place; back to [T, Hq, d],
       padding rows zeroed.
    """
    T, Hq, d = q.shape
    P, ps, H2d = kv_pages.shape
    Hkv = H2d // (2 * d)
    G = Hq // Hkv
    S, n = page_table.shape
    fp8 = kv_scales is not None
    pps = pages_per_step or max(1, min(n, 128 // ps))
    interpret = _interpret() if interpret is None else interpret
    Tp = -(-T // block_q) * block_q
    nb, R = Tp // block_q, block_q * G
    W = nb + S  # items: every block once, plus one extra per sequence boundary

    token_seq = jnp.pad(token_seq.astype(jnp.int32), (0, Tp - T), constant_values=-1)
    positions = jnp.pad(positions.astype(jnp.int32), (0, Tp - T))
    qt = jnp.pad(q, ((0, Tp - T), (0, 0), (0, 0))).reshape(Tp, Hkv, G, d).transpose(1, 0, 2, 3)
    qt = qt.reshape(Hkv, Tp * G, d)  # [Hkv, Tp*G, d]
    row_pos = jnp.repeat(positions, G)[:, None]  # [Tp*G, 1]
    block, seq, lo, hi, pages, first, last, n_runs = _work_items(token_seq, positions, block_q, ps, W)

    q_spec = pl.BlockSpec((Hkv, R, d), lambda i, blk, *_: (0, blk[i], 0))
    in_specs = [q_spec, pl.BlockSpec((R, 1), lambda i, blk, *_: (blk[i], 0)), pl.BlockSpec(memory_space=pl.ANY)]
    scratch = [pltpu.VMEM((2, pps * ps, H2d), kv_pages.dtype)]
    args = [qt, row_pos, kv_pages]
    if fp8:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        scratch.append(pltpu.VMEM((2, pps * ps, 2 * Hkv), jnp.float32))
        args.append(kv_scales.astype(jnp.float32))
    scratch += [pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((Hkv, R, 1), jnp.float32),
                pltpu.VMEM((Hkv, R, 1), jnp.float32), pltpu.VMEM((Hkv, R, d), jnp.float32)]
    kernel = functools.partial(_attention_kernel, block_q=block_q, group=G, head_dim=d, page_size=ps,
                               pages_per_step=pps, max_pages=n, fp8=fp8)
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=8, grid=(W,), in_specs=in_specs,
                                             out_specs=q_spec, scratch_shapes=scratch)
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)), interpret=interpret,
        name="ragged_paged_attention",
    )(block, seq, lo, hi, pages, first, last, page_table.astype(jnp.int32).reshape(-1), *args)
    o = out.reshape(Hkv, Tp, G, d).transpose(1, 0, 2, 3).reshape(Tp, Hq, d)[:T]
    o = jnp.where((token_seq[:T] >= 0)[:, None, None], o, 0)
    return jnp.where(n_runs > W, jnp.nan, o).astype(q.dtype)


def _write_kernel(page_ref, tile_ref, rows_ref, new_ref, kv_in, kv_out, buf, sem, *, block_t: int, tile: int):
    """Merge each group's new rows into its cache tile in HBM, read-modify-write (kv_out aliases kv_in).

    A group is a run of tokens writing one tile (`tile` rows of one page; DMAs must start at a tile boundary on
    TPU, so a single row cannot be copied alone). SMEM [Tp]: page_ref (the page of the group starting at this
    token, -1 elsewhere and for padding), tile_ref (the tile's first row in its page), rows_ref (bit r set: the
    group writes row r of the tile); new_ref [bt, tile, 2*Hkv*d] (slot j: the new rows of the group starting at
    token j); kv_out [P, ps, 2*Hkv*d] in HBM, indexed by (page, rows): nothing reshaped; buf [bt, tile, 2*Hkv*d].
    1. DMA in the tile of every group of this block; 2. keep its old rows but the group's new ones;
    3. DMA the tiles back, then wait for them all.
    """
    del kv_in
    b = pl.program_id(0)

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


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def write_kv_pages_pallas(kv_pages, kv_scales, k, v, page, offset, *, block_t: int = 32,
                          interpret: bool | None = None):
    """The KV-cache write of `attention_xla.write_kv_pages`, the rows moved by a Pallas DMA kernel, in place.

    kv_pages [P, ps, 2*Hkv*d]; kv_scales [P, ps, 2*Hkv] | None; k, v [T, Hkv, d]; page, offset [T].
    Precondition (the engine's `RaggedMeta` meets it): tokens writing the same tile of a page are contiguous.
    1. interleave K and V per head -> [T, 2*Hkv*d]; for FP8 quantize with per-(token, head) scales amax / 448
       (elementwise, left to XLA) and store the scales with an XLA scatter (4 bytes per row)
    2. group the tokens: a run writing one tile of 8 rows (ps when ps is not a multiple of 8) inside a block of
       bt tokens; place each group's new rows in a [tile, 2*Hkv*d] slot (XLA scatter, a few rows per token)
    3. Pallas: per group one DMA of the tile in, the merge, one DMA back into the aliased cache (page 0 = padding:
       skipped; the null page's contents are never read for a real token). In place when the caller donates it.
    """
    T, Hkv, d = k.shape
    ps = kv_pages.shape[1]
    tr = 8 if ps % 8 == 0 else ps
    if tr > 32:
        raise ValueError(f"page_size {ps}: the Pallas KV write needs a multiple of 8 or at most 32 (row bit masks)")
    interpret = _interpret() if interpret is None else interpret
    kv = jnp.stack([k, v], axis=2).reshape(T, 2 * Hkv, d)  # [T, 2*Hkv, d]
    if kv_scales is not None:
        kv32 = kv.astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(kv32), axis=-1), 1e-12) / FP8_MAX  # [T, 2*Hkv]
        kv = kv32 / scale[..., None]
        kv_scales = kv_scales.at[page, offset].set(scale)
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
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(Tp // bt,),
        in_specs=[pl.BlockSpec((bt, tr, 2 * Hkv * d), lambda b, *_: (b, 0, 0)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((bt, tr, 2 * Hkv * d), kv.dtype), pltpu.SemaphoreType.DMA((1,))])
    out = pl.pallas_call(
        functools.partial(_write_kernel, block_t=bt, tile=tr), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype), input_output_aliases={4: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)), interpret=interpret,
        name="kv_cache_write",
    )(jnp.where(start, pg, -1), off // tr * tr, rows, new, kv_pages)
    return out, kv_scales


register("attention", "pallas")(AttentionKernels(dense=attention_xla, paged=paged_attention_pallas,
                                                 write=write_kv_pages_pallas))
