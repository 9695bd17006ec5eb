"""Grouped SwiGLU expert FFNs in XLA: the `moe_matmul` slot's `ragged_dot`, `loop` and `capacity`, and the forms
they run inside (`moe_tiled`: capacity's fallback; `moe_blocked`: the loop at decode sizes; `moe_loop_fused`).

Protocol: `fn(x_sorted, group_sizes, w_gate_up, w_down, fp8_block) -> y_sorted`
- x_sorted: [N, D], rows sorted by expert, group e holding `group_sizes[e]` rows (rows past the sum are padding);
- w_gate_up: [E, D, 2, F] (gate | up), w_down: [E, F, D], each a dense array or a `BlockFP8` pair;
- y_sorted: [N, D] in x's dtype, row r = down(silu(gate(x_r)) * up(x_r)) of its expert, 0 for padding rows;
  both matmuls accumulate in float32 and the result is rounded to x's dtype once (the model rounds it there
  before the combine anyway; in bf16 this halves the bytes the combine reads).
Dropless: every row is computed, whatever the group sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.kernels.registry import register
from qwen35_lib.weights import BlockFP8, dequantize_fp8


def _dense(w, block: int | None, dtype) -> jax.Array:
    return dequantize_fp8(w, block, dtype) if isinstance(w, BlockFP8) else w


def _swiglu(h: jax.Array, dtype) -> jax.Array:
    """h: [..., 2, F] float32 (gate | up) -> silu(gate) * up in `dtype`."""
    return (jax.nn.silu(h[..., 0, :]) * h[..., 1, :]).astype(dtype)


def _expert(w, e, block: int | None, dtype) -> jax.Array:
    """W[e] of a stacked expert weight (a traced index), FP8 ones dequantized after the index."""
    if isinstance(w, BlockFP8):
        return dequantize_fp8(BlockFP8(w.value[e][None], w.scale[e][None]), block, dtype)[0]
    return w[e]


@register("moe_matmul", "ragged_dot")
def moe_ragged_dot(x, group_sizes, w_gate_up, w_down, fp8_block=None):
    """`jax.lax.ragged_dot` twice. Exact and simple; on CPU ~150x slower than its FLOPs (the reference)."""
    E, D, _, F = w_gate_up.value.shape if isinstance(w_gate_up, BlockFP8) else w_gate_up.shape
    wgu = _dense(w_gate_up, fp8_block, x.dtype).reshape(E, D, 2 * F)
    h = jax.lax.ragged_dot(x, wgu, group_sizes, preferred_element_type=jnp.float32)  # [N, 2F]
    a = _swiglu(h.reshape(-1, 2, F), x.dtype)  # [N, F]
    return jax.lax.ragged_dot(a, _dense(w_down, fp8_block, x.dtype), group_sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)  # [N, D]


def tile_rows(n_rows: int, num_experts: int) -> int:
    """Rows per tile: about the mean group size, a power of two in [8, 128]."""
    mean = max(1, n_rows // num_experts)
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def moe_tiled(x, group_sizes, w_gate_up, w_down, fp8_block=None, tile: int | None = None):
    """Each group padded to whole tiles of m rows; one batched matmul over tiles with each tile's expert weights.
    `moe_capacity`'s fallback, no slot implementation of its own (`bench kernels` times it: `bench.kernels_moe`).

    What a TPU grouped-matmul kernel does, written with XLA ops:
    1. padded group sizes = ceil(size / m) * m; each sorted row moves to its group's padded block;
    2. tile t (of cdiv(N, m) + E, a static bound) belongs to the expert whose padded block covers it;
    3. gather each tile's expert weights (FP8 ones dequantized after the gather) and run both matmuls per tile;
    4. gather the rows back to sorted order.
    Wasted work: at most m - 1 padding rows per expert.
    """
    N, D = x.shape
    E = group_sizes.shape[0]
    m = tile or tile_rows(N, E)
    num_tiles = -(-N // m) + E
    ends = jnp.cumsum(group_sizes)  # [E]
    padded = (group_sizes + m - 1) // m * m
    padded_ends = jnp.cumsum(padded)
    row = jnp.arange(N)
    g = jnp.searchsorted(ends, row, side="right")  # [N] group of each sorted row (E for padding rows)
    gc = jnp.minimum(g, E - 1)
    dest = padded_ends[gc] - padded[gc] + row - (ends[gc] - group_sizes[gc])  # [N] row in the padded layout
    dest = jnp.where(g < E, dest, num_tiles * m)  # padding rows go nowhere
    xp = jnp.zeros((num_tiles * m, D), x.dtype).at[dest].set(x, mode="drop").reshape(num_tiles, m, D)
    tile_expert = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * m, side="right"), E - 1)

    def take(w):  # [E, ...] -> [num_tiles, ...] (dequantized per tile)
        if isinstance(w, BlockFP8):
            return dequantize_fp8(BlockFP8(w.value[tile_expert], w.scale[tile_expert]), fp8_block, x.dtype)
        return w[tile_expert]

    h = jnp.einsum("tmd,tdcf->tmcf", xp, take(w_gate_up), preferred_element_type=jnp.float32)
    a = _swiglu(h, x.dtype)  # [num_tiles, m, F]
    y = jnp.einsum("tmf,tfd->tmd", a, take(w_down), preferred_element_type=jnp.float32).astype(x.dtype)
    return y.reshape(num_tiles * m, D).at[dest].get(mode="fill", fill_value=0)  # [N, D]


def loop_tile(n_rows: int, num_experts: int) -> int:
    """Rows per step of `moe_loop`: the mean group size rounded up to a power of two, in [4, 32] (at decode sizes
    4 rows per tile beat 1: fewer loop steps for the same dots, 3.4 vs 8.2 ms a layer of qwen3.5-mini at 8 tokens)."""
    mean = -(-n_rows // num_experts)
    return int(min(32, max(4, 1 << max(0, mean - 1).bit_length())))


BLOCKED_MAX_MEAN = 8  # `moe_loop` runs as `moe_blocked` up to this many rows per expert on average (decode sizes)


@register("moe_matmul", "loop")
def moe_loop(x, group_sizes, w_gate_up, w_down, fp8_block=None, tile: int | None = None):
    """A loop over the experts that have rows, and inside it over tiles of m of the expert's rows: only the
    weights of experts with rows are touched, once each, and only real rows are computed.

    1. active experts (size > 0), in order; an outer `fori_loop` over them (data dependent count) takes W[e];
    2. an inner `fori_loop` over the ceil(size_e / m) tiles: m rows from the group's start (x padded by m zero
       rows, so a slice never clamps), both matmuls with W[e], rows past the group zeroed, written at the same
       rows of y. Groups run in row order, so a tile's rows past its group are overwritten by the groups that own
       them; padding rows end 0.
    Wasted work: under m rows per active expert (m ~ the mean group). On XLA:CPU this beats the batched
    `capacity` path at every size measured (qwen3.5-mini layer: 3.0 vs 8.0 ms at 8 tokens, 33 vs 98 ms at 512):
    that path computes C slots of every expert (8x the rows at 8 tokens) and reads every expert's weights.
    Where its time goes at decode sizes: XLA:CPU copies the dynamic slice W[e] (0.75 MB a mini expert) before
    the dots, ~2/3 of the loop (`jax.profiler`, qwen3.5-mini at 8 tokens); the dots then read it from cache.
    At decode sizes (no `tile` given, at most `BLOCKED_MAX_MEAN` rows per expert on average) it runs as
    `moe_blocked`: the same copies, a quarter of the loop steps and ops (qwen3.5-mini, 8 layers at 8 tokens,
    interleaved on a busy 2-core machine: 8.25 -> 7.06 ms a layer median, 4.67 -> 3.54 min, CPU time 5.0 ->
    3.75; at 64 tokens 19.3 -> 18.3 median; at 512 tokens the loop stays: blocked 48.7 -> 67.8).
    """
    N, D = x.shape
    E = group_sizes.shape[0]
    if tile is None and N <= BLOCKED_MAX_MEAN * E:
        return moe_blocked(x, group_sizes, w_gate_up, w_down, fp8_block)
    m = tile or loop_tile(N, E)
    starts = jnp.cumsum(group_sizes) - group_sizes
    active = jnp.nonzero(group_sizes > 0, size=E, fill_value=0)[0]  # [E] experts with rows first
    xp = jnp.concatenate([x, jnp.zeros((m, D), x.dtype)])  # [N + m, D]

    def expert(i, y):
        e = active[i]
        wgu, wd = _expert(w_gate_up, e, fp8_block, x.dtype), _expert(w_down, e, fp8_block, x.dtype)

        def tile_rows(j, y):
            r0 = starts[e] + j * m
            rows = jax.lax.dynamic_slice_in_dim(xp, r0, m)  # [m, D]
            h = jnp.einsum("md,dkf->mkf", rows, wgu, preferred_element_type=jnp.float32)
            o = jnp.einsum("mf,fd->md", _swiglu(h, x.dtype), wd, preferred_element_type=jnp.float32).astype(x.dtype)
            o = jnp.where((jnp.arange(m) < group_sizes[e] - j * m)[:, None], o, 0)
            return jax.lax.dynamic_update_slice_in_dim(y, o, r0, 0)

        return jax.lax.fori_loop(0, (group_sizes[e] + m - 1) // m, tile_rows, y)

    y = jax.lax.fori_loop(0, jnp.sum(group_sizes > 0), expert, jnp.zeros((N + m, D), x.dtype))
    return y[:N]


def moe_loop_fused(x, ids, weights, num_groups: int, w_gate_up, w_down, fp8_block=None, tile: int | None = None):
    """`moe_loop` with the dispatch and the combine inside it: the routed experts' output [T, D] from the tokens
    x [T, D], their experts ids [T, k] and routing weights [T, k] (ids >= the expert count: routed nowhere).

    The permute slot's `dispatch` writes every copy of every row sorted by expert ([T*k, D]), `moe_loop` zeroes
    an output as large and writes each tile into it, and `combine` zeroes and scatters it once more before the
    weighted sum: at prefill sizes those full-size buffers cost about as much as the grouped matmul's dots
    (qwen3.5-mini at 2,048 tokens: 33 MB each). Here only the sort stays ([T*k] indices):
    1. sort the copies by expert (stable, as `permute.xla.dispatch_xla`); group sizes over `num_groups`;
    2. a loop over the experts with rows, W[e] taken once each, and inside it over tiles of m sorted copies:
       gather the m tokens' rows of x, both matmuls, the result rounded to x's dtype (as `moe_loop` returns it),
       times the copy's routing weight (in x's dtype, as the combine multiplies), scatter-added into a float32
       [T, D] (copies past the group go to no row); the sum rounded to x's dtype once.
    Equal to dispatch -> `moe_loop` -> combine up to the order of each token's k-term sum. `routed_experts` uses
    it where `moe_loop` would run its loop (`fuses`); decode sizes keep `moe_blocked` and the permute slot.
    """
    T, D = x.shape
    k = ids.shape[1]
    E = (w_gate_up.value if isinstance(w_gate_up, BlockFP8) else w_gate_up).shape[0]
    m = tile or loop_tile(T * k, E)
    flat = ids.reshape(T * k)
    order = jnp.argsort(flat, stable=True)  # sorted position -> copy
    group_sizes = jnp.bincount(flat, length=num_groups).astype(jnp.int32)[:E]
    pad = lambda a, v: jnp.concatenate([a, jnp.full((m,), v, a.dtype)])  # a slice of m never clamps
    tok = pad((order // k).astype(jnp.int32), T)  # [T*k + m] token of each sorted copy
    wt = pad(weights.reshape(T * k).astype(x.dtype)[order].astype(jnp.float32), 0)
    starts = jnp.cumsum(group_sizes) - group_sizes
    active = jnp.nonzero(group_sizes > 0, size=E, fill_value=0)[0]

    def expert(i, out):
        e = active[i]
        wgu, wd = _expert(w_gate_up, e, fp8_block, x.dtype), _expert(w_down, e, fp8_block, x.dtype)

        def tile_rows(j, out):
            r0 = starts[e] + j * m
            live = jnp.arange(m) < group_sizes[e] - j * m
            t = jnp.where(live, jax.lax.dynamic_slice_in_dim(tok, r0, m), T)  # [m]; T: no row
            rows = jnp.take(x, t, axis=0, mode="clip")  # [m, D]
            h = jnp.einsum("md,dkf->mkf", rows, wgu, preferred_element_type=jnp.float32)
            o = jnp.einsum("mf,fd->md", _swiglu(h, x.dtype), wd, preferred_element_type=jnp.float32).astype(x.dtype)
            contrib = o.astype(jnp.float32) * jax.lax.dynamic_slice_in_dim(wt, r0, m)[:, None]
            return out.at[t].add(contrib, mode="drop")

        return jax.lax.fori_loop(0, (group_sizes[e] + m - 1) // m, tile_rows, out)

    out = jax.lax.fori_loop(0, jnp.sum(group_sizes > 0), expert, jnp.zeros((T, D), jnp.float32))
    return out.astype(x.dtype)


moe_loop.fused = moe_loop_fused
moe_loop.fuses = lambda copies, num_experts: copies > BLOCKED_MAX_MEAN * num_experts  # where the loop runs


def moe_blocked(x, group_sizes, w_gate_up, w_down, fp8_block=None, tile: int | None = None, block: int = 4):
    """The experts' row tiles, `block` of them at a time: a loop over only the tiles that hold rows, each step one
    gather of its tiles' expert weights and rows and one batched matmul pair (what `moe_loop` does one expert and
    one tile at a time, in a tenth of the loop steps at decode sizes). The form `moe_loop` takes at decode sizes, no
    slot implementation of its own (`bench kernels` times it: `bench.kernels_moe`).

    1. tiles: ceil(size_e / m) of m rows per expert, in expert order (a static bound of cdiv(N, m) + E of them;
       `n_tiles` hold rows); tile t's expert, its first sorted row, and which of its m rows are real;
    2. a `fori_loop` over ceil(n_tiles / block) blocks: gather the block's expert weights [b, D, 2, F] and
       [b, F, D] (FP8 ones dequantized after the gather; a block's padding tiles take its first tile's expert, so
       they read weights already in cache) and rows [b, m, D]; the two batched matmuls; scatter each real row's
       output to its sorted row (padding rows dropped).
    Every expert with rows has its weights copied once per tile of m rows (once at decode sizes, where a group
    rarely exceeds m); padding rows end 0. Bytes: the touched experts, like `moe_loop`; loop steps and ops per
    step: n_tiles / block instead of n_tiles, so the per-op cost of XLA:CPU's thunks is paid block times less.
    """
    N, D = x.shape
    E = group_sizes.shape[0]
    m = tile or loop_tile(N, E)
    tiles_per = (group_sizes + m - 1) // m  # [E]
    tile_ends = jnp.cumsum(tiles_per)
    n_tiles = tile_ends[-1]
    bound = -(-(-(-N // m) + E) // block) * block  # static bound on the tiles, whole blocks
    t = jnp.arange(bound)
    te = jnp.searchsorted(tile_ends, t, side="right")  # [bound] expert of each tile (E past n_tiles)
    tec = jnp.minimum(te, E - 1)
    j = t - (tile_ends[tec] - tiles_per[tec])  # tile index within its expert
    starts = jnp.cumsum(group_sizes) - group_sizes
    r = jnp.arange(m)
    real = (te < E)[:, None] & (r[None, :] < (group_sizes[tec] - j * m)[:, None])  # [bound, m]
    rows = jnp.where(real, (starts[tec] + j * m)[:, None] + r[None, :], N)  # [bound, m]; N: a zero row / dropped
    xp = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])

    def take(w, e):  # [E, ...] -> [b, ...] (dequantized per tile)
        if isinstance(w, BlockFP8):
            return dequantize_fp8(BlockFP8(w.value[e], w.scale[e]), fp8_block, x.dtype)
        return w[e]

    def step(i, y):
        e = jax.lax.dynamic_slice_in_dim(te, i * block, block)
        e = jnp.where(e < E, e, e[0])  # padding tiles: the block's first expert (cached)
        rb = jax.lax.dynamic_slice_in_dim(rows, i * block, block)  # [b, m]
        h = jnp.einsum("bmd,bdkf->bmkf", xp[rb], take(w_gate_up, e), preferred_element_type=jnp.float32)
        o = jnp.einsum("bmf,bfd->bmd", _swiglu(h, x.dtype), take(w_down, e),
                       preferred_element_type=jnp.float32).astype(x.dtype)
        return y.at[rb.reshape(-1)].set(o.reshape(-1, D), mode="drop")

    return jax.lax.fori_loop(0, (n_tiles + block - 1) // block, step, jnp.zeros((N, D), x.dtype))


@register("moe_matmul", "capacity")
def moe_capacity(x, group_sizes, w_gate_up, w_down, fp8_block=None, sigmas: float = 4.0):
    """Expert-major slots: each expert's rows in C slots, so both matmuls use the expert weights in place, as one
    batched matmul [E, C, D] x [E, D, 2F]. C = mean + `sigmas` * sqrt(mean) + 2 rounded up to a multiple of 8,
    with mean = N / E rows per expert: balanced routing puts a Poisson-like count on each expert, so C holds every
    group with high probability (1.2x the mean at 4096 tokens on qwen3.5-mini, a few rows at decode sizes).

    1. slot (e, c) reads sorted row start_e + c when c < size_e, else a zero row (a gather: faster than
       scattering rows into slots on XLA:CPU);
    2. both matmuls batched over experts; 3. each sorted row reads its slot back (padding rows read 0).
    Dropless and exact: when any group is larger than C, the step falls back to `moe_tiled` (`lax.cond`), so
    the cost is data dependent, never the result. Padding slots cost (C - size) rows per expert.
    """
    N, D = x.shape
    E = group_sizes.shape[0]
    mean = N / E
    C = -(-int(np.ceil(mean + sigmas * np.sqrt(mean) + 2)) // 8) * 8  # a power of two wasted up to 2x at 4096 tokens
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    row = jnp.arange(N)
    g = jnp.searchsorted(ends, row, side="right")  # [N] group of each sorted row (E for padding rows)
    gc = jnp.minimum(g, E - 1)
    slot = jnp.where(g < E, gc * C + row - starts[gc], E * C)  # [N]
    c = jnp.arange(C)
    src = jnp.where(c[None, :] < group_sizes[:, None], starts[:, None] + c[None, :], N)  # [E, C] row, or N: zeros

    def in_place(x):
        xe = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[src]  # [E, C, D]
        h = jnp.einsum("ecd,edkf->eckf", xe, _dense(w_gate_up, fp8_block, x.dtype), preferred_element_type=jnp.float32)
        y = jnp.einsum("ecf,efd->ecd", _swiglu(h, x.dtype), _dense(w_down, fp8_block, x.dtype),
                       preferred_element_type=jnp.float32).astype(x.dtype)  # rounded before the gather: half the bytes
        return y.reshape(E * C, D).at[slot].get(mode="fill", fill_value=0)

    overflow = lambda x: moe_tiled(x, group_sizes, w_gate_up, w_down, fp8_block)
    return jax.lax.cond(jnp.max(group_sizes) <= C, in_place, overflow, x)
