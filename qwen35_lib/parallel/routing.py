"""The MoE across devices: tensor-parallel experts, or expert parallelism with two token-routing strategies.

All take the flat tokens `x [N, D]` and return the MoE output [N, D] (under `ep` without the shared expert,
which the model adds, data-parallel). Sizes come from the context mesh (`jax.set_mesh`): `ep` devices (every
device of the ('chip', 'core') mesh), E/ep experts each.
Each runs as a `shard_map` over the context mesh, so every collective is written out
(check_vma off: Pallas kernels inside then run in the plain HLO interpreter off a TPU; the TPU interpreter's
cross-device shared memory deadlocks 8 simulated devices on 2 cores):

- `tp`  (layouts tp, tp_kvrep): tokens replicated, `W[E, D, F_x]`: every device runs every expert on its
  F/tp slice, partial sums all-reduced (`psum`). The shared expert is split the same way and joins the sum.
- `ep` + `replicate`: tokens split over devices `x[N_x, D]`, `W[E_x, D, F]`:
  1. all-gather the hidden states, the top-k ids and the weights (3 all-gathers; 2 with `fuse_allgather`);
  2. each device runs its E/ep local experts on the token copies routed to them, and only those
     (`local_experts`: a buffer of N·min(k, E/ep) rows, the worst case; the rows used are the local copies);
  3. reduce-scatter the partial outputs back to the token shards (flat, or `hierarchical_rs`).
- `ep` with every token on every device (`tp_ep`) + `replicate`: no all-gather; each device runs its local experts
  and its F_s/ep slice of the shared expert on all tokens, one all-reduce sums them (`moe_ep_everywhere`);
  + `all_to_all`: each device takes its 1/n of the tokens (a slice, no collective) into the routing below, and
  the output is all-gathered back to every device.
- `ep` + `all_to_all`: each device sends each of its tokens once to every device owning one of its experts
  (deduplicated: a token with 3 experts on one device is one row there), with that device's expert ids and
  weights, in a buffer of `cap` rows per destination (dropless: cap = n, every token could go to one device;
  with `capacity_factor` tokens past cap are dropped and their copies counted); the owner runs its experts and
  weighs them, a second all-to-all brings one partial sum per (token, destination) home, summed there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from qwen35_lib.config import Config
from qwen35_lib.kernels import for_plan
from qwen35_lib.kernels.registry import pallas_interpret
from qwen35_lib.kernels.stacked import LayerOf
from qwen35_lib.parallel.collectives import all_gather, gather_routing, reduce_scatter, token_axes
from qwen35_lib.plan import ALL, ServingPlan
from qwen35_lib.weights import BlockFP8

PERMUTE_SCOPE = "permute"  # the named scope of the MoE's dispatch and combine


def local_experts(cfg: Config, plan: ServingPlan, w_gate_up, w_down, x: jax.Array, ids: jax.Array,
                  weights: jax.Array, first: jax.Array | int, count: int, all_local: bool = False) -> jax.Array:
    """Σ_j weights_j * expert_{ids_j}(x) over the copies whose expert is in [first, first + count).

    x [N, D], ids/weights [N, k] (global expert ids); w_* hold the `count` local experts.
    1. each copy's local expert id, `count` for another device's expert: a trailing group the grouped matmul never
       computes (its rows give 0);
    2. the permute slot sorts the N·k copies by it, gathering each row from x once; the grouped matmul runs the
       local groups (the kernels `plan` names);
    3. the permute slot's combine sums each token's local copies, weighted (other devices' copies weigh 0).
    The routed rows are written once (the gather) and read once (the combine), as production's layer moves them
    (`costmodel` `kernels_moe_permute_passes`). `all_local` (the TP MoE: every expert here, every id in range)
    skips the masks.
    """
    permute, matmul = for_plan("permute", plan), for_plan("moe_matmul", plan)
    mine = jnp.ones(ids.shape, bool) if all_local else (ids >= first) & (ids < first + count)  # [N, k]
    groups = count if all_local else count + 1
    with jax.named_scope(PERMUTE_SCOPE):  # the compiled permute's ops, by name (`costmodel.compiled`)
        x_sorted, sizes, order = permute.dispatch(x, jnp.where(mine, ids - first, count), groups)  # [N*k, D]
    y = matmul(x_sorted, sizes[:count], w_gate_up, w_down, cfg.fp8_block_size)  # [N*k, D]: 0 past the local rows
    with jax.named_scope(PERMUTE_SCOPE):
        return permute.combine(y, order, jnp.where(mine, weights, 0)).astype(x.dtype)  # [N, D]


def fused_local_experts(cfg: Config, plan: ServingPlan, w_gate_up, w_down, x: jax.Array, ids: jax.Array,
                        first: jax.Array, count: int, own_ids: jax.Array, tm: int | None = None) -> jax.Array:
    """The local experts on the gathered copies routed to them, in one kernel that fetches their rows and sends each
    output row to its token's owner (`kernels.moe.fused_ep`): this device's tokens' copies [n, k, *view] (each row
    in the kernel's tile view, (D/128, 128); unwritten where a copy routes nowhere), for the caller to weigh and
    sum.

    x [N, D] and ids [N, k] gathered (device-major: token t is device t // n's), own_ids [n, k] this device's.
    1. the N·k copies sorted by local expert, others' last (int32 work: no row is moved here); `copy` [N·k]: each
       sorted row's flat copy index t·k + j, -1 for the rows of other devices' experts;
    2. the kernel fetches the routed rows, runs the local groups and sends each row home as its tile finishes
       (`tm`: its row tile, default by shape); it returns once every copy of this device's own tokens that routes
       somewhere has arrived (`expect`). Off a TPU in the TPU interpreter (`moe_ep` runs `fused_twin` there).
    """
    from qwen35_lib.kernels.moe.fused_ep import moe_fused_ep

    N, k = ids.shape
    n = own_ids.shape[0]
    mine = ((ids >= first) & (ids < first + count)).reshape(-1)  # [N*k]
    with jax.named_scope(PERMUTE_SCOPE):
        order = jnp.argsort(jnp.where(mine, ids.reshape(-1) - first, count), stable=True)  # [N*k]
        sizes = jnp.bincount(jnp.where(mine, ids.reshape(-1) - first, count), length=count).astype(jnp.int32)
        copy = jnp.where(mine[order], order, -1).astype(jnp.int32)  # [N*k]
    expect = jnp.sum(own_ids < cfg.num_experts, dtype=jnp.int32)  # copies of this device's tokens
    mesh = jax.sharding.get_abstract_mesh()
    recv = moe_fused_ep(x, copy, sizes, w_gate_up, w_down, cfg.fp8_block_size, k, expect, n * k,
                        tuple(mesh.shape[a] for a in ALL), interpret=pallas_interpret(plan.platform), tm=tm)
    return recv.reshape(n, k, *recv.shape[1:])  # [n, k, *view]


def fused_twin(cfg: Config, plan: ServingPlan, w_gate_up, w_down, x: jax.Array, ids: jax.Array, first: jax.Array,
               count: int, own_ids: jax.Array) -> jax.Array:
    """`fused_local_experts`' XLA twin, what `moe_ep` runs off a TPU: the same copies [n, k, *view] in XLA ops.

    1. the permute slot sorts the copies and the moe_matmul slot runs the local groups (as `local_experts`);
    2. each output row is put at its flat copy index t·k + j of a zero [N·k, D] buffer, and one reduce-scatter
       hands each device its tokens' n·k rows: a copy's row comes from the one device owning its expert (the others
       add exact zeros), as the kernel's remote DMAs deliver it.
    Why not the kernel: in jax 0.10.2 the TPU interpreter (which the kernel's remote DMAs need) runs it in a layer and
    in `forward` on the 8 simulated devices (tests), but inside the engine's step every device's thread blocks in
    the interpreter's first buffer allocation (`interpret_pallas_call._allocate_buffer`, the np.array of its operand
    device_put to CPU device 0) and the step never returns.
    """
    permute, matmul = for_plan("permute", plan), for_plan("moe_matmul", plan)
    (N, k), D = ids.shape, x.shape[1]
    n = own_ids.shape[0]
    mine = (ids >= first) & (ids < first + count)  # [N, k]
    with jax.named_scope(PERMUTE_SCOPE):
        x_sorted, sizes, order = permute.dispatch(x, jnp.where(mine, ids - first, count), count + 1)  # [N*k, D]
    y = matmul(x_sorted, sizes[:count], w_gate_up, w_down, cfg.fp8_block_size)  # [N*k, D]: 0 past the local rows
    y = jnp.where(mine.reshape(-1)[order][:, None], y, 0)
    full = jnp.zeros((N * k, D), y.dtype).at[order].set(y)  # [N*k, D] in copy order
    recv = jax.lax.psum_scatter(full, ALL, scatter_dimension=0, tiled=True)  # [n*k, D]
    return recv.reshape(n, k, *((D // 128, 128) if D % 128 == 0 else (1, D)))


def _spec_like(w, spec: P):
    """The same PartitionSpec for a dense weight or both halves of a BlockFP8 pair (of a `LayerOf`'s stack)."""
    if isinstance(w, LayerOf):
        return w.in_specs(spec)
    return BlockFP8(spec, spec) if isinstance(w, BlockFP8) else spec


def moe_tp(cfg: Config, w: dict, x: jax.Array, ids: jax.Array, weights: jax.Array, shared_fn,
           plan: ServingPlan) -> jax.Array:
    """Routed + shared experts, tensor-parallel over the FFN dim (the bound TP `plan`); returns the full MoE
    output [N, D]."""
    tp = plan.tp_axes
    f = P(None, None, None, tp)  # [E, D, 2, F_x]

    def body(x, ids, weights, w_gate_up, w_down, shared):
        y = local_experts(cfg, plan, w_gate_up, w_down, x, ids, weights, 0, cfg.num_experts, all_local=True)
        y = y + shared_fn(shared, x)  # the shared expert's partial sum over its F/tp slice
        return jax.lax.psum(y, tp)

    shared = {n: w[n] for n in ("shared_gate_up", "shared_down", "shared_gate")}
    shared_specs = dict(shared_gate_up=P(None, None, tp), shared_down=P(tp, None), shared_gate=P())
    return jax.shard_map(body, in_specs=(P(), P(), P(), _spec_like(w["w_gate_up"], f),
                                         _spec_like(w["w_down"], P(None, tp, None)), shared_specs),
                         out_specs=P(), check_vma=False)(x, ids, weights, w["w_gate_up"], w["w_down"], shared)


def moe_ep_everywhere(cfg: Config, w: dict, x: jax.Array, ids: jax.Array, weights: jax.Array, shared_fn,
                      plan: ServingPlan) -> jax.Array:
    """Routed + shared experts under expert parallelism with every token on every device (`tp_ep` + `replicate`,
    tpu-inference's TP8_EP): the full MoE output [N, D].

    1. the routing (ids, weights [N, k]) is the same on every device (the router is replicated, so are the tokens):
       no all-gather;
    2. each device runs its E/ep local experts on the copies routed to them (`local_experts`), and the shared
       expert on its F_s/ep slice (`ffn` is split as the attention heads are; whole on device 0 alone where F_s does
       not divide);
    3. one all-reduce (`psum` over every device) sums the partial outputs.
    """
    mesh = jax.sharding.get_abstract_mesh()
    ep = math.prod(mesh.shape[a] for a in ALL)
    count = cfg.num_experts // ep
    split = cfg.shared_ffn % ep == 0
    ffn = ALL if split else None

    def body(x, ids, weights, w_gate_up, w_down, shared):
        me = jax.lax.axis_index(ALL)
        y = local_experts(cfg, plan, w_gate_up, w_down, x, ids, weights, me * count, count)  # [N, D]
        s = shared_fn(shared, x)  # [N, D]: its F_s/ep slice's partial sum (or the whole of it)
        y = y + (s if split else jnp.where(me == 0, s, jnp.zeros_like(s)))
        return jax.lax.psum(y, ALL)

    shared = {n: w[n] for n in ("shared_gate_up", "shared_down", "shared_gate")}
    shared_specs = dict(shared_gate_up=P(None, None, ffn), shared_down=P(ffn, None), shared_gate=P())
    return jax.shard_map(body, in_specs=(P(), P(), P(), _spec_like(w["w_gate_up"], P(ALL)),
                                         _spec_like(w["w_down"], P(ALL)), shared_specs),
                         out_specs=P(), check_vma=False)(x, ids, weights, w["w_gate_up"], w["w_down"], shared)


def moe_ep(cfg: Config, w: dict, x: jax.Array, route_fn, plan: ServingPlan, *, with_rows: bool = False):
    """Routed experts under expert parallelism over every device: (out [N, D], dropped copies []), and with
    `with_rows` the rows each device moved [ep] (replicate: local copies run; all_to_all: token rows sent).

    Tokens are split evenly over the ep devices (padded to a multiple of ep); each device routes its own tokens
    (`route_fn(cfg, router, x) -> (weights, ids)`, the router replicated), so routing needs no collective. The
    bound EP `plan` says how tokens are routed (its routing, collective flags, capacity and kernels).
    """
    mesh = jax.sharding.get_abstract_mesh()
    ep = math.prod(mesh.shape[a] for a in ALL)
    if cfg.num_experts % ep:
        raise ValueError(f"{cfg.num_experts} experts cannot be split evenly over {ep} devices: use an expert count "
                         f"that is a multiple of {ep}")
    count = cfg.num_experts // ep
    N = x.shape[0]
    pad = -N % ep
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    rows = P(ALL)

    def body(x, router, w_gate_up, w_down):
        weights, ids = route_fn(cfg, router, x)  # [n, k] each, this device's tokens
        if pad:  # padding tokens route nowhere: no rows moved for them
            real = jax.lax.axis_index(ALL) * x.shape[0] + jnp.arange(x.shape[0]) < N
            ids = jnp.where(real[:, None], ids, cfg.num_experts)
        if plan.routing == "all_to_all":
            y, dropped, moved = _all_to_all(cfg, plan, w_gate_up, w_down, x, ids, weights, ep, count)
            return y, dropped[None], moved[None]
        order = token_axes(plan.hierarchical_rs)  # the device order reduce_scatter returns each device's rows in
        xa = all_gather(x, order)  # [N, D]
        ida, wa = gather_routing(ids, weights, plan.fuse_allgather, order)  # [N, k]
        first = jax.lax.axis_index(ALL) * count
        moved = jnp.sum((ida >= first) & (ida < first + count), dtype=jnp.int32)
        if plan.fused_combine:  # each routed row sent home from the kernel; this device's tokens' copies here
            fused = fused_twin if pallas_interpret(plan.platform) else fused_local_experts  # see fused_twin
            recv = fused(cfg, plan, w_gate_up, w_down, xa, ida, first, count, ids)  # [n, k, D/128, 128]: as DMA'd
            if pad:  # padding tokens' copies route nowhere: their rows were never written (a select over recv)
                recv = jnp.where((ids < cfg.num_experts)[..., None, None], recv, 0)
            y = jnp.einsum("nkab,nk->nab", recv, weights.astype(recv.dtype),
                           preferred_element_type=jnp.float32)  # weighed in the rows' view: no relayout of recv
            return y.astype(x.dtype).reshape(x.shape), jnp.zeros((1,), jnp.int32), moved[None]
        y = local_experts(cfg, plan, w_gate_up, w_down, xa, ida, wa, first, count)  # [N, D] partial sums
        rs = reduce_scatter(y, plan.hierarchical_rs, plan.rs_slices(N + pad, ep), order)
        return rs, jnp.zeros((1,), jnp.int32), moved[None]

    out, dropped, moved = jax.shard_map(body, in_specs=(rows, P(), _spec_like(w["w_gate_up"], P(ALL)),
                                                        _spec_like(w["w_down"], P(ALL))),
                                        out_specs=(rows, P(ALL), P(ALL)), check_vma=False)(
        x, w["router"], w["w_gate_up"], w["w_down"])
    return (out[:N], jnp.sum(dropped), moved) if with_rows else (out[:N], jnp.sum(dropped))


def a2a_cap(cfg: Config, plan: ServingPlan, n: int, ep: int) -> int:
    """Rows per destination of the all-to-all buffer, for n tokens a device: n dropless (each token at most once
    per destination), else ceil(capacity_factor · n·k / ep) (the mean copies per destination; the plan's
    `capacity_factor`), at most n."""
    k, f = cfg.num_experts_per_tok, plan.capacity_factor
    return n if f is None else min(n, max(1, math.ceil(f * n * k / ep)))


def _all_to_all(cfg: Config, plan: ServingPlan, w_gate_up, w_down, x, ids, weights, ep: int, count: int):
    """One device's side of all-to-all routing. x [n, D], ids/weights [n, k] ->
    (out [n, D], dropped copies [], token rows sent []).

    1. token t goes to each device e owning one of its experts (hit [n, ep]), into row pos of that device's
       buffer, pos = how many earlier tokens go there; tokens with pos >= cap are dropped there;
    2. all-to-all the buffers [ep, cap, D], with each row's local expert ids and weights packed as int32
       [ep, cap, 2k] (ids `count`, weight 0 for experts elsewhere and for empty rows);
    3. run the local experts on the received rows, weighted (`local_experts`): one partial sum per row;
    4. all-to-all back; each token sums its rows.
    """
    n, D = x.shape
    k = ids.shape[1]
    cap = a2a_cap(cfg, plan, n, ep)
    dest = ids // count  # [n, k]
    hit = jnp.any(dest[:, :, None] == jnp.arange(ep)[None, None, :], axis=1)  # [n, ep]
    pos = jnp.cumsum(hit, axis=0, dtype=jnp.int32) - 1  # [n, ep]
    keep = hit & (pos < cap)
    slot = jnp.where(keep, jnp.arange(ep)[None, :] * cap + pos, ep * cap)  # [n, ep]; ep * cap = not sent
    src = jnp.full((ep * cap,), n, jnp.int32).at[slot.reshape(-1)].set(
        jnp.repeat(jnp.arange(n, dtype=jnp.int32), ep), mode="drop")  # [ep*cap]: token of each row (n: empty)
    real = src < n
    safe = jnp.minimum(src, n - 1)
    row_dest = jnp.arange(ep * cap) // cap  # [ep*cap]
    here = real[:, None] & (dest[safe] == row_dest[:, None])  # [ep*cap, k]: the row's copies on its device
    send_x = jnp.where(real[:, None], x[safe], 0)  # [ep*cap, D]
    send_ids = jnp.where(here, ids[safe] % count, count).astype(jnp.int32)
    bits = jax.lax.bitcast_convert_type(jnp.where(here, weights[safe], 0).astype(jnp.float32), jnp.int32)
    a2a = lambda a: jax.lax.all_to_all(a.reshape(ep, cap, *a.shape[1:]), ALL, 0, 0, tiled=True).reshape(
        ep * cap, *a.shape[1:])
    recv_x, recv = a2a(send_x), a2a(jnp.concatenate([send_ids, bits], axis=1))  # [ep*cap, D], [ep*cap, 2k]
    recv_w = jax.lax.bitcast_convert_type(recv[:, k:], jnp.float32).astype(weights.dtype)
    y = local_experts(cfg, plan, w_gate_up, w_down, recv_x, recv[:, :k], recv_w, 0, count)  # [ep*cap, D]
    back = a2a(y)  # [ep*cap, D]: row (e, pos) = device e's partial sum for token src
    out = jnp.zeros((n, D), jnp.float32).at[src].add(back.astype(jnp.float32), mode="drop")
    copies = jnp.sum(dest[:, :, None] == jnp.arange(ep)[None, None, :], axis=1)  # [n, ep]
    dropped = jnp.sum(jnp.where(hit & ~keep, copies, 0), dtype=jnp.int32)
    return out.astype(x.dtype), dropped, jnp.sum(keep, dtype=jnp.int32)


def _dest_hits(cfg: Config, ids, ep: int):
    """ids [N, k] split over ep source devices -> copies [ep source, n, ep dest] per token and destination."""
    import numpy as np

    ids = np.asarray(ids)
    n, k = ids.shape[0] // ep, ids.shape[1]
    dest = ids.reshape(ep, n, k) // (cfg.num_experts // ep)
    return (dest[..., None] == np.arange(ep)).sum(axis=2)  # [ep, n, ep]


def predicted_drops(cfg: Config, plan: ServingPlan, ids, ep: int = 8) -> int:
    """Copies all_to_all drops for routing `ids` [N, k] (N split over ep devices): for every source device and
    destination, the copies of the tokens past the first `a2a_cap` tokens that go there."""
    import numpy as np

    copies = _dest_hits(cfg, ids, ep)
    cap = a2a_cap(cfg, plan, copies.shape[1], ep)
    order = np.cumsum(copies > 0, axis=1)  # [ep, n, ep]: 1-based rank of each token going there
    return int(copies[order > cap].sum())


def predicted_rows(cfg: Config, plan: ServingPlan, ids, ep: int = 8):
    """Rows each device moves for routing `ids` [N, k] (N split over ep devices), numpy [ep]: replicate, the
    local copies its experts run (of the N·k gathered); all_to_all, the token rows it sends (one per token and
    destination device, at most `a2a_cap` per destination)."""
    import numpy as np

    ids = np.asarray(ids)
    count = cfg.num_experts // ep
    if plan.routing == "replicate":
        return np.bincount((ids // count).reshape(-1), minlength=ep)[:ep]
    hit = _dest_hits(cfg, ids, ep) > 0  # [ep, n, ep]
    return np.minimum(hit.sum(axis=1), a2a_cap(cfg, plan, hit.shape[1], ep)).sum(axis=1)


def run_layer(cfg: Config, plan: ServingPlan, weights: dict, x, mesh, group: int = 0, position: int = 0):
    """`moe_ep` of one layer of the model's `weights` (placed on `mesh` under the EP `plan`, bound here) on
    x [N, D]: numpy (out [N, D] without the shared expert, dropped copies)."""
    import numpy as np

    from qwen35_lib.model.moe import route
    from qwen35_lib.parallel.shardings import shard_weights

    plan = plan.bound(mesh, cfg)
    layer = jax.tree.map(lambda a: a[group, position], shard_weights(cfg, plan, weights, mesh)["layers"]["moe"])
    with jax.set_mesh(mesh):
        out, dropped = jax.jit(lambda w, x: moe_ep(cfg, w, x, route, plan))(layer, jnp.asarray(x))
    return np.asarray(out), int(dropped)
