"""Per-rank kernel calls under a layout: `vmap` over the data-parallel rank axis R, and, for Pallas kernels on a
mesh, inside a `shard_map` (XLA cannot partition a Mosaic kernel itself: each device runs it on its own ranks).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from qwen35_lib.config import Config
from qwen35_lib.plan import ALL, ServingPlan


def per_rank(cfg: Config, slot: str, fn: Callable, *args, plan: ServingPlan):
    """`jax.vmap(fn)(*args)` over the leading R of every array in `args` (None entries pass through).

    With a Pallas kernel in `slot` (as the bound `plan` names it) under a multi-device layout, the vmap runs in a
    `shard_map` that gives each device its own ranks where every mesh axis splits ranks (`dp_ep`, `dp8_ep8`; any mesh
    size), and its ranks and its heads where a layout splits heads too (`_ranks_and_heads`: the TP baseline with
    Pallas kernels, `google_baseline`; `dp_tp2_ep`). The XLA attention under a layout whose every axis splits ranks
    runs in that `shard_map` too: each device runs its own ranks, as a DP rank does in production (partitioned by XLA
    instead, its loop over pages all-reduces the loop condition across devices every iteration: a collective whose
    count depends on the data). Under a layout that
    splits ranks over some axes and heads over the others (`dp_tp2_ep`), the XLA attention runs in a `shard_map` of
    ranks and heads (`_ranks_and_heads`). The XLA GDN stays partitioned by XLA (no collective under `dp_ep`; inside
    the `shard_map` libtpu's TPU7x compile crashes on it there).
    """
    f = jax.vmap(fn)
    layout = plan
    pallas = plan.kernel(slot) == "pallas"
    if not pallas and slot == "attention" and layout.layout != "single" and layout.batch_axes not in (None, ALL):
        return _ranks_and_heads(f, fn, args, layout, slot)  # (the GDN's too passes on CPU; its TPU7x compile unread)
    if layout.layout == "single" or (not pallas and (slot != "attention" or layout.batch_axes != ALL)):
        return f(*args)
    if layout.batch_axes != ALL:  # heads split too (tp8_kvrep's google_baseline, dp_tp2_ep): each device its heads
        return _ranks_and_heads(f, fn, args, layout, slot)
    specs = jax.tree.map(lambda _: P(ALL), args)
    return jax.shard_map(f, in_specs=specs, out_specs=P(ALL), check_vma=False)(*args)


def per_device(fn: Callable, x: jax.Array, *shared, plan: ServingPlan):
    """`fn(x, *shared)` on each device's own rows: x's leading dim split over every mesh axis (the data-parallel
    ranks of a layout whose every axis splits ranks: `dp_ep`), `shared` (pytrees) whole on every device; on one
    device a plain call. A Pallas kernel reading stacked weights in place runs so (`model.layer_loop.with_dense`)."""
    if plan.layout == "single":
        return fn(x, *shared)
    n = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in ALL)
    if plan.batch_axes != ALL or x.shape[0] % n:
        raise ValueError(f"a kernel that reads stacked weights runs on each device's own rows: layout "
                         f"{plan.layout!r} with {x.shape[0]} leading rows on {n} devices does not split them so; "
                         f"use layout 'dp_ep' or the plan's dense_kernel='xla'")
    specs = jax.tree.map(lambda _: P(), shared)
    return jax.shard_map(fn, in_specs=(P(ALL), *specs), out_specs=P(ALL), check_vma=False)(x, *shared)


# the attention slot's per-rank arrays [R, ...] by parameter name: the dim of their heads (`kernels.attention.xla`:
# q [R, T, Hq, d], k / v [R, T, Hkv, d], kv_pages [R, P, ps, 2·Hkv·d] (head h's K and V side by side, so an even
# split of the last dim is a split of the heads), kv_scales [R, P, 2·Hkv, ps]); other arrays are per rank only
# ; the GDN slot's (`kernels.gdn.xla.gdn_ragged_xla`): q, k [R, T, Hk, dk], v [R, T, Hv, dv], g, beta [R, T, Hv],
# states [R, NS, Hv, dk, dv]; its `meta` (a pytree) per rank only
_HEAD_DIM = {"attention": {"q": 2, "k": 2, "v": 2, "kv_pages": 3, "kv_scales": 2},
             "gdn": {"q": 2, "k": 2, "v": 2, "g": 2, "beta": 2, "states": 2}}


def _ranks_and_heads(f: Callable, fn: Callable, args: tuple, plan: ServingPlan, slot: str):
    """The kernel `f` (vmapped `fn`; XLA's or Pallas') of `slot` under a layout that splits heads over some axes
    (`dp_tp2_ep`: ranks over `chip`, heads over `core`; `tp_kvrep`: heads over both), in a `shard_map` that gives
    each device its ranks and its heads: the kernel then runs on each device's own data (partitioned by XLA
    instead, the attention's page loop was split over the tokens with collectives inside a loop of data-dependent
    trips, and the GDN's state gathers and scatters moved heads between the cores). A dim whose size the head axes
    do not divide stays whole."""
    import inspect

    batch, heads = plan.batch_axes, plan.axes("gdn_v_heads" if slot == "gdn" else "kv_heads")
    head_dim = _HEAD_DIM.get(slot, {})
    n = jax.sharding.get_abstract_mesh().shape
    ways = 1 if heads is None else (n[heads] if isinstance(heads, str) else int(np.prod([n[a] for a in heads])))
    names = list(inspect.signature(fn).parameters)

    def spec(name, a):
        if a is None:
            return None
        if not hasattr(a, "ndim"):  # a pytree of per-rank arrays (the GDN's meta)
            return jax.tree.map(lambda _: P(batch), a)
        dim = head_dim.get(name)
        return P(batch, *[heads if i == dim and a.shape[i] % ways == 0 else None for i in range(1, a.ndim)])

    in_specs = tuple(spec(name, a) for name, a in zip(names, args))
    by_shape = {a.shape: sp for a, sp in zip(args, in_specs) if hasattr(a, "ndim")}
    out = jax.eval_shape(f, *args)
    out_specs = jax.tree.map(lambda o: by_shape.get(o.shape, P(batch)), out)
    return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
