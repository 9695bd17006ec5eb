"""The MoE across devices: tensor-parallel experts, or expert parallelism with two token-routing strategies.

All take the flat tokens `x [N, D]` and return the MoE output [N, D] (under `ep` without the shared expert,
which the model adds, data-parallel).
Each runs as a `shard_map` over the context mesh (`jax.set_mesh`), so every collective is written out
(check_vma off: Pallas kernels inside then run in the plain HLO interpreter off a TPU; the TPU interpreter's
cross-device shared memory deadlocks 8 simulated devices on 2 cores):

- `tp`  (layouts tp8, tp8_kvrep): tokens replicated, `W[E, D, F_x]`: every device runs every expert on its
  F/8 slice, partial sums all-reduced (`psum`). The shared expert is split the same way and joins the sum.
- `ep` + `replicate`: tokens split over devices `x[N_x, D]`, `W[E_x, D, F]`:
  1. all-gather the hidden states, the top-k ids and the weights (3 all-gathers; 2 with `fuse_allgather`);
  2. each device runs its E/8 local experts on the token copies routed to them (others weigh 0);
  3. reduce-scatter the partial outputs back to the token shards (flat, or `hierarchical_rs`).
- `ep` + `all_to_all`: each device sends each token copy to the device owning its expert, in a buffer of
  `cap` rows per destination (dropless: cap = all local copies; with `capacity_factor` copies past cap are
  dropped and counted), the owner runs its experts, a second all-to-all brings the outputs home.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from qwen35_lib.config import Config
from qwen35_lib.kernels import for_config
from qwen35_lib.parallel.collectives import all_gather, gather_routing, reduce_scatter
from qwen35_lib.parallel.layouts import get_layout
from qwen35_lib.parallel.mesh import EIGHT
from qwen35_lib.weights import BlockFP8


def local_experts(cfg: Config, w_gate_up, w_down, x: jax.Array, ids: jax.Array, weights: jax.Array,
                  first: jax.Array | int, count: int) -> jax.Array:
    """Σ_j weights_j * expert_{ids_j}(x) over the copies whose expert is in [first, first + count).

    x [N, D], ids/weights [N, k] (global expert ids); w_* hold the `count` local experts. Copies routed
    elsewhere go to a trailing group `count` that the grouped matmul never computes (rows past the sum).
    """
    lid = ids - first
    mine = (lid >= 0) & (lid < count)  # [N, k]
    lid = jnp.where(mine, lid, count)
    permute = for_config("permute", cfg)
    x_sorted, sizes, order = permute.dispatch(x, lid, count + 1)  # [N*k, D], [count + 1]
    y = for_config("moe_matmul", cfg)(x_sorted, sizes[:count], w_gate_up, w_down, cfg.fp8_block_size)
    return permute.combine(y, order, jnp.where(mine, weights, 0)).astype(x.dtype)  # [N, D]


def _spec_like(w, spec: P):
    """The same PartitionSpec for a dense weight or both halves of a BlockFP8 pair."""
    return BlockFP8(spec, spec) if isinstance(w, BlockFP8) else spec


def moe_tp(cfg: Config, w: dict, x: jax.Array, ids: jax.Array, weights: jax.Array, shared_fn) -> jax.Array:
    """Routed + shared experts, tensor-parallel over the FFN dim; returns the full MoE output [N, D]."""
    tp = get_layout(cfg.layout).tp_axes
    f = P(None, None, None, tp)  # [E, D, 2, F_x]

    def body(x, ids, weights, w_gate_up, w_down, shared):
        y = local_experts(cfg, w_gate_up, w_down, x, ids, weights, 0, cfg.num_experts)
        y = y + shared_fn(shared, x)  # the shared expert's partial sum over its F/8 slice
        return jax.lax.psum(y, tp)

    shared = {n: w[n] for n in ("shared_gate_up", "shared_down", "shared_gate")}
    shared_specs = dict(shared_gate_up=P(None, None, tp), shared_down=P(tp, None), shared_gate=P())
    return jax.shard_map(body, in_specs=(P(), P(), P(), _spec_like(w["w_gate_up"], f),
                                         _spec_like(w["w_down"], P(None, tp, None)), shared_specs),
                         out_specs=P(), check_vma=False)(x, ids, weights, w["w_gate_up"], w["w_down"], shared)


def moe_ep(cfg: Config, w: dict, x: jax.Array, route_fn) -> tuple[jax.Array, jax.Array]:
    """Routed experts under expert parallelism over ('chip', 'core'): (out [N, D], dropped copies []).

    Tokens are split evenly over the 8 devices (padded to a multiple of 8); each device routes its own tokens
    (`route_fn(cfg, router, x) -> (weights, ids)`, the router replicated), so routing needs no collective.
    """
    mesh = jax.sharding.get_abstract_mesh()
    ep = math.prod(mesh.shape[a] for a in EIGHT)
    count = cfg.num_experts // ep
    N = x.shape[0]
    pad = -N % ep
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    rows = P(EIGHT)

    def body(x, router, w_gate_up, w_down):
        weights, ids = route_fn(cfg, router, x)  # [n, k] each, this device's tokens
        if cfg.routing == "all_to_all":
            y, dropped = _all_to_all(cfg, w_gate_up, w_down, x, ids, weights, ep, count)
            return y, dropped[None]
        xa = all_gather(x)  # [N, D]
        ida, wa = gather_routing(ids, weights, cfg.fuse_allgather)  # [N, k]
        first = jax.lax.axis_index(EIGHT) * count
        y = local_experts(cfg, w_gate_up, w_down, xa, ida, wa, first, count)  # [N, D] partial sums
        return reduce_scatter(y, cfg.hierarchical_rs), jnp.zeros((1,), jnp.int32)

    out, dropped = jax.shard_map(body, in_specs=(rows, P(), _spec_like(w["w_gate_up"], P(EIGHT)),
                                                 _spec_like(w["w_down"], P(EIGHT))),
                                 out_specs=(rows, P(EIGHT)), check_vma=False)(x, w["router"], w["w_gate_up"],
                                                                              w["w_down"])
    return out[:N], jnp.sum(dropped)


def _all_to_all(cfg: Config, w_gate_up, w_down, x, ids, weights, ep: int, count: int):
    """One device's side of all-to-all routing. x [n, D], ids/weights [n, k] -> (out [n, D], dropped []).

    1. copy c = (token c // k, its j-th expert) goes to device dest = id // count, into row pos of that
       device's buffer, pos = how many earlier copies go there; copies with pos >= cap are dropped;
    2. all-to-all the buffers [ep, cap, D] (and the local expert ids, `count` marking empty rows);
    3. run the local experts on the received rows (weight 1);
    4. all-to-all back; each copy reads its row, and a token sums its k copies, weighted.
    """
    n, D = x.shape
    k = ids.shape[1]
    c = n * k
    cap = c if cfg.capacity_factor is None else max(1, math.ceil(cfg.capacity_factor * c / ep))
    dest = (ids // count).reshape(c)  # [c]
    pos = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(dest, ep, dtype=jnp.int32), axis=0) - 1,
                              dest[:, None], axis=1)[:, 0]  # [c]
    keep = pos < cap
    slot = jnp.where(keep, dest * cap + pos, ep * cap)  # [c]; ep * cap = dropped
    send_x = jnp.zeros((ep * cap, D), x.dtype).at[slot].set(x[jnp.arange(c) // k], mode="drop")
    send_e = jnp.full((ep * cap,), count, jnp.int32).at[slot].set((ids % count).reshape(c), mode="drop")
    a2a = lambda a: jax.lax.all_to_all(a.reshape(ep, cap, *a.shape[1:]), EIGHT, 0, 0, tiled=True)
    recv_x, recv_e = a2a(send_x).reshape(ep * cap, D), a2a(send_e).reshape(ep * cap, 1)
    y = local_experts(cfg, w_gate_up, w_down, recv_x, recv_e, jnp.ones_like(recv_e, x.dtype), 0, count)
    back = a2a(y).reshape(ep * cap, D).at[slot].get(mode="fill", fill_value=0)  # [c, D]
    out = jnp.einsum("nkd,nk->nd", back.reshape(n, k, D), weights.astype(back.dtype),
                     preferred_element_type=jnp.float32)
    return out.astype(x.dtype), c - jnp.sum(keep, dtype=jnp.int32)


def collective_bytes(cfg: Config, N: int) -> dict[str, int]:
    """Predicted result bytes per device of each collective kind in one EP MoE layer with N tokens in the step
    (split over 8 devices, n = N / 8 each; b = bytes of cfg.dtype):

    replicate:  all-gathers N·D·b (hidden) + N·k·4 (ids) + N·k·b (weights); reduce-scatter n·D·b
    all_to_all: 2 · 8·cap·D·b (dispatch and return) + 8·cap·4 (expert ids), cap = n·k dropless,
                else ceil(capacity_factor · n·k / 8) rows per destination.
    """
    D, k, b, n = cfg.hidden_size, cfg.num_experts_per_tok, jnp.dtype(cfg.dtype).itemsize, N // 8
    if cfg.routing == "replicate":
        return {"all-gather": N * D * b + N * k * 4 + N * k * b, "reduce-scatter": n * D * b}
    cap = n * k if cfg.capacity_factor is None else max(1, math.ceil(cfg.capacity_factor * n * k / 8))
    return {"all-to-all": 2 * 8 * cap * D * b + 8 * cap * 4}


def wire_bytes(cfg: Config, N: int) -> float:
    """Bytes one device receives (all-gather, all-to-all: 7/8 of the result) or sends (reduce-scatter: 7/8 of its
    N·D·b input) in one EP MoE layer."""
    return sum(v * 7 / 8 * (8 if kind == "reduce-scatter" else 1) for kind, v in collective_bytes(cfg, N).items())


def predicted_drops(cfg: Config, ids) -> int:
    """Copies all_to_all drops for routing `ids` [N, k] (N split over 8 devices): for every source device and
    destination, max(0, copies - cap)."""
    import numpy as np

    ids = np.asarray(ids)
    n, k = ids.shape[0] // 8, ids.shape[1]
    cap = n * k if cfg.capacity_factor is None else max(1, math.ceil(cfg.capacity_factor * n * k / 8))
    dest = ids.reshape(8, n * k) // (cfg.num_experts // 8)  # [source device, copies]
    return int(sum(max(0, int((d == j).sum()) - cap) for d in dest for j in range(8)))


def run_layer(cfg: Config, weights: dict, x, mesh, group: int = 0, position: int = 0):
    """`moe_ep` of one layer of the model's `weights` (placed on `mesh` under cfg.layout) on x [N, D]:
    numpy (out [N, D] without the shared expert, dropped copies)."""
    import numpy as np

    from qwen35_lib.model.moe import route
    from qwen35_lib.parallel.layouts import shard_weights

    layer = jax.tree.map(lambda a: a[group, position], shard_weights(cfg, weights, mesh)["layers"]["moe"])
    with jax.set_mesh(mesh):
        out, dropped = jax.jit(lambda w, x: moe_ep(cfg, w, x, route))(layer, jnp.asarray(x))
    return np.asarray(out), int(dropped)
