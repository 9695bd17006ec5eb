"""The grouped-matmul variants `bench kernels` times beside the `moe_matmul` slot's implementations, none of them a
slot implementation (a plan cannot name them):
- `tiled` (`kernels.moe.xla.moe_tiled`): `capacity`'s fallback when a group overflows its slots, timed on its own;
- `blocked` (`kernels.moe.xla.moe_blocked`): the form `loop` takes at decode sizes, timed on its own;
- megablox `gmm` (`moe_megablox`, JAX's Pallas grouped matmul): a comparison for the slot's Pallas kernel (interpret
  mode off a TPU: numerics only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.moe.xla import moe_blocked, moe_tiled
from qwen35_lib.kernels.registry import pallas_interpret
from qwen35_lib.weights import BlockFP8, dequantize_fp8

VARIANTS = {"tiled": moe_tiled, "blocked": moe_blocked}  # name -> fn, the slot's protocol
MEGABLOX = "megablox gmm"


def moe_megablox(x, group_sizes, w_gate_up, w_down, fp8_block=None, group_offset=None, *, interpret=None,
                 tm: int = 128):
    """The same FFN from JAX's megablox `gmm` (two grouped matmuls, SwiGLU between in XLA): a comparison for the
    `moe_matmul` slot's Pallas kernel, no slot implementation.

    FP8 weights are dequantized in XLA first (megablox has no block scales). Rows outside the local groups are
    zeroed here: megablox leaves them unwritten.
    """
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    interpret = pallas_interpret() if interpret is None else interpret
    dense = lambda w: dequantize_fp8(w, fp8_block, x.dtype) if isinstance(w, BlockFP8) else w
    wgu, wd = dense(w_gate_up), dense(w_down)
    (N, D), E, F = x.shape, wgu.shape[0], wd.shape[1]
    tm = min(tm, -(-N // 8) * 8)
    xp = jnp.pad(x, ((0, -N % tm), (0, 0)))  # megablox wants whole row tiles
    off = None if group_offset is None else jnp.asarray(group_offset, jnp.int32).reshape(())
    sizes = group_sizes.astype(jnp.int32)
    tile = lambda n, pref: next((t for t in (pref, 512, 256, 128) if t <= n and n % t == 0), n)  # divides n
    h = gmm(xp, wgu.reshape(E, D, 2 * F), sizes, jnp.float32, (tm, tile(D, 512), tile(2 * F, 1024)), off,
            interpret=interpret)  # [N, 2F]
    a = (jax.nn.silu(h[:, :F]) * h[:, F:]).astype(x.dtype)
    y = gmm(a, wd, sizes, x.dtype, (tm, tile(F, 512), tile(D, 1024)), off, interpret=interpret)  # [N, D]
    ends = jnp.cumsum(sizes)
    o = 0 if off is None else off
    lo = jnp.where(o > 0, ends[jnp.maximum(o - 1, 0)], 0)
    hi = ends[jnp.minimum(o + E, sizes.shape[0]) - 1]
    row = jnp.arange(y.shape[0])[:, None]
    return jnp.where((row >= lo) & (row < hi), y, jnp.zeros((), y.dtype))[:N]
