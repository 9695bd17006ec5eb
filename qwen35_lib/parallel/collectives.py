"""Collectives for the MoE under expert parallelism, each with its plain twin (used inside `shard_map`).

- `gather_routing`: the top-k ids and weights of every token, all-gathered: two all-gathers, or one over a
  packed int32 array (`fuse_allgather`: with the hidden states, 3 all-gathers become 2).
- `reduce_scatter`: `psum_scatter` over both mesh axes, or hierarchically (`hierarchical_rs`): over `core`
  (inside a chip), then over `chip` (across chips), in micro-batches so the second phase of one micro-batch can
  overlap the first phase of the next. The MoE gathers its tokens in `token_axes` order: over ('core', 'chip')
  when hierarchical, so each phase scatters contiguous blocks and no block is reordered.
- `on_each_device`, `reduce_scatter_ops`: run a collective by hand on the 8 devices, and read the reduce-scatters
  XLA compiles for the hierarchical version (notebook 04).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qwen35_lib.plan import ALL

HIER_AXES = ("core", "chip")  # the hierarchical reduce-scatter's device order: its phases' order, major first


def token_axes(hierarchical: bool) -> tuple[str, ...]:
    """The device order to gather the MoE's tokens in (`all_gather`, `gather_routing`) for `reduce_scatter`:
    ALL = ('chip', 'core') flat; HIER_AXES = ('core', 'chip') hierarchical, device (chip c, core j)'s rows at
    block j * chips + c, so a scatter over `core` keeps a contiguous half and the one over `chip` a contiguous
    quarter of it (in ALL order the blocks were transposed to [core, chip] first: a relayout of the combine's
    [N, D] rows every layer on TPU7x, 0.9 of its 2.9 passes in the kernels stage's mixed step)."""
    return HIER_AXES if hierarchical else ALL


def all_gather(x: jax.Array, axes=ALL) -> jax.Array:
    """[n, ...] per device -> [N = n * devices, ...], device-major (device i's rows at [i*n, (i+1)*n))."""
    return jax.lax.all_gather(x, axes, axis=0, tiled=True)


def gather_routing(ids: jax.Array, weights: jax.Array, fused: bool, axes=ALL) -> tuple[jax.Array, jax.Array]:
    """All-gather the routing: ids [n, k] int32, weights [n, k] -> ids [N, k], weights [N, k] (same dtype).

    fused: 1. the weights are bitcast to int32 (as float32) and packed beside the ids: [n, 2k] int32;
    2. one all-gather; 3. unpacked and bitcast back. Bit-exact; one collective instead of two.
    """
    if not fused:
        return all_gather(ids, axes), all_gather(weights, axes)
    k = ids.shape[1]
    bits = jax.lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.int32)  # [n, k]
    packed = all_gather(jnp.concatenate([ids.astype(jnp.int32), bits], axis=1), axes)  # [N, 2k]
    w = jax.lax.bitcast_convert_type(packed[:, k:], jnp.float32).astype(weights.dtype)
    return packed[:, :k], w


def reduce_scatter(x: jax.Array, hierarchical: bool, micro_batches: int = 2, order=ALL) -> jax.Array:
    """Sum `x` [N, ...] over all devices and keep this device's block of n = N / devices rows, x's rows being
    blocks in `order` (ALL or HIER_AXES; the MoE's tokens are gathered in `token_axes(hierarchical)`): each device
    keeps its own block, as one `psum_scatter` over `order` does (the flat version; the 8-device figures below
    are the ('chip' 4, 'core' 2) mesh's: device (c, j)'s block is 2c + j in ALL order, 4j + c in HIER_AXES).
    Hierarchical:
    1. each block's n rows split into `micro_batches` slices, blocks viewed in HIER_AXES order ([core, chip], so a
       scatter over `core` keeps core j's contiguous half and the one over `chip` chip c's quarter of it): a view
       when x is in that order; from ALL order the [chip, core] blocks are transposed (a relayout on TPU7x);
    2. for each micro-batch i: its [core * chip, n/m] rows (a slice, copied once), psum_scatter over `core` (the
       2 cores of a chip exchange halves), then over `chip` (4 chips exchange quarters of what is left); with 1
       micro-batch in HIER_AXES order the phases read x itself;
    3. the slices are concatenated back. The phases of different micro-batches are independent, so XLA can
       run one's inter-chip phase while the next one's intra-chip phase is in flight.
    """
    if tuple(order) not in (ALL, HIER_AXES):
        raise ValueError(f"reduce_scatter: rows in device order {order}; gather them in ALL {ALL} or HIER_AXES "
                         f"{HIER_AXES} (token_axes)")
    if not hierarchical:
        return jax.lax.psum_scatter(x, tuple(order), scatter_dimension=0, tiled=True)
    n_chip, n_core = jax.lax.axis_size("chip"), jax.lax.axis_size("core")
    N, rest = x.shape[0], x.shape[1:]
    n = N // (n_chip * n_core)  # rows each device keeps
    m = micro_batches if n % micro_batches == 0 else 1
    if tuple(order) == HIER_AXES:
        blocks = x.reshape(n_core * n_chip, m, n // m, *rest)  # [core * chip, mb, n/m, ...]: a view
    else:  # [chip, core] blocks transposed to [core, chip]
        blocks = jnp.swapaxes(x.reshape(n_chip, n_core, m, n // m, *rest), 0, 1).reshape(n_core * n_chip, m, -1, *rest)
    out = []
    for i in range(m):
        whole = m == 1 and tuple(order) == HIER_AXES
        part = x if whole else blocks[:, i].reshape(N // m, *rest)  # [core * chip * n/m, ...]
        part = jax.lax.psum_scatter(part, "core", scatter_dimension=0, tiled=True)  # [chip * n/m, ...]
        out.append(jax.lax.psum_scatter(part, "chip", scatter_dimension=0, tiled=True))  # [n/m, ...]
    return out[0] if m == 1 else jnp.concatenate(out, axis=0)  # [n, ...]


def on_each_device(fn, x, mesh) -> np.ndarray:
    """fn on each device of the ('chip', 'core') `mesh`: x [8, ...] (device i's slab at [i]) -> [8, ...] of
    fn(x[i]) stacked in device order. For trying a collective by hand: fn runs inside `shard_map`."""
    run = jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P(ALL), out_specs=P(ALL))
    return np.asarray(jax.jit(run)(jnp.asarray(x)))


def reduce_scatter_ops(mesh, micro_batches: int, rows: int = 512, cols: int = 4096, dtype=jnp.bfloat16) -> list:
    """The reduce-scatters XLA compiles for `reduce_scatter(hierarchical=True)` of [rows, cols] partial sums per
    device on `mesh` (8 CPU devices, or `aot.chip_core_mesh()` for TPU7x): `hlo.Collective`s in program order,
    two per micro-batch (result rows rows / 2 / m after `core`, rows / 8 / m after `chip`)."""
    from qwen35_lib.parallel import hlo

    run = jax.shard_map(lambda v: reduce_scatter(v[0], True, micro_batches)[None], mesh=mesh,
                        in_specs=P(ALL), out_specs=P(ALL))
    spec = jax.ShapeDtypeStruct((mesh.devices.size, rows, cols), dtype, sharding=NamedSharding(mesh, P(ALL)))
    return [op for op in hlo.collectives(jax.jit(run).lower(spec).compile().as_text()) if op.kind == "reduce-scatter"]
