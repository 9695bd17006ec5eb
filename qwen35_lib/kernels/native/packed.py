"""Weights re-laid for the native CPU kernels: a matrix stored as its 64-column panels, each a contiguous stream.

`PanelPacked` holds a weight of logical shape [*lead, *K, *N] (lead: batch dims such as the experts; K: the
contracted dims; N: the output dims) as data [*lead, K * N]: the [K, N] matrix's panels of PANEL columns one after
another, each [K, width] row-major, the last one narrower where N is not a multiple of PANEL. The handlers
(`native/gemm.h`) read a panel's 64 columns of every row (one AVX-512 register block, four AVX2 or NEON ones side by
side): row-major, that is 256 bytes every N * 4, which the CPU's prefetchers follow worse than one stream. The
layout is the same for every ISA variant of the handlers (`native.ISAS`). `model.layer_loop.prepare_weights`
packs per-layer weights for the CPU where the native kernels load (`moe.native.pack_experts`,
`dense.native.pack_dense`); the XLA paths unpack, or read the panels with a batched dot.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

PANEL = 64  # columns of a panel (native/gemm.h kPanel), whatever the ISA


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PanelPacked:
    """A weight stored panel-major (see the module). `shape`, `dtype`, `ndim` are the logical weight's."""

    data: jax.Array  # [*lead, K * N]
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    row_major: jax.Array | None = None  # the logical array too, where a caller keeps it (`dense.native.pack_dense`)
    lead: int = dataclasses.field(default=0, metadata=dict(static=True))  # leading batch dims
    k_dims: int = dataclasses.field(default=1, metadata=dict(static=True))  # contracted dims after them

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def kn(self) -> tuple[int, int]:
        """(K, N): the contracted and output sizes of the matrix."""
        k_end = self.lead + self.k_dims
        return math.prod(self.shape[self.lead:k_end]), math.prod(self.shape[k_end:])


def panels(N: int) -> list[tuple[int, int]]:
    """(first column, width) of each panel of an N-column matrix."""
    return [(n, min(PANEL, N - n)) for n in range(0, N, PANEL)]


def pack_panels(w: jax.Array, lead: int = 0, k_dims: int = 1) -> PanelPacked:
    """w [*lead, *K, *N] -> `PanelPacked` (a copy)."""
    out = PanelPacked(None, tuple(w.shape), lead=lead, k_dims=k_dims)
    K, N = out.kn
    m = w.reshape(*w.shape[:lead], K, N)
    data = jnp.concatenate([m[..., n:n + width].reshape(*w.shape[:lead], K * width) for n, width in panels(N)], -1)
    return dataclasses.replace(out, data=data)


def unpack_panels(w):
    """The logical array of a `PanelPacked` (anything else as given)."""
    if not isinstance(w, PanelPacked):
        return w
    K, N = w.kn
    lead = w.shape[:w.lead]
    parts = [w.data[..., K * n:K * (n + width)].reshape(*lead, K, width) for n, width in panels(N)]
    return jnp.concatenate(parts, -1).reshape(w.shape)
