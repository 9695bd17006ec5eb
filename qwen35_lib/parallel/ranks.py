"""Per-rank kernel calls under a layout: `vmap` over the data-parallel rank axis R, and, for Pallas kernels on a
mesh, inside a `shard_map` (XLA cannot partition a Mosaic kernel itself: each device runs it on its own ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from qwen35_lib.config import Config
from qwen35_lib.plan import ALL, ServingPlan
from qwen35_lib.plan.kernels import KERNEL_FIELDS


def per_rank(cfg: Config, slot: str, fn: Callable, *args, plan: ServingPlan):
    """`jax.vmap(fn)(*args)` over the leading R of every array in `args` (None entries pass through).

    With a Pallas kernel in `slot` (as the bound `plan` names it) under a multi-device layout, the vmap runs in a
    `shard_map` that gives each device its own ranks: this needs every mesh axis to split ranks (`dp_ep`, `dp8_ep8`;
    any mesh size); other layouts split heads too, which these kernels do not take yet, and are refused with the
    fix. The XLA attention under a layout whose every axis splits ranks runs in that `shard_map` too: each device
    runs its own ranks, as a DP rank does in production (partitioned by XLA instead, its loop over pages all-reduces
    the loop
    condition across devices every iteration: a collective whose count depends on the data). The XLA GDN stays
    partitioned by XLA (no collective; inside the `shard_map` libtpu's TPU7x compile crashes on it).
    """
    f = jax.vmap(fn)
    layout = plan
    field = KERNEL_FIELDS[slot]
    pallas = plan.kernel(slot) == "pallas"
    if layout.layout == "single" or (not pallas and (slot != "attention" or layout.batch_axes != ALL)):
        return f(*args)
    if layout.batch_axes != ALL:
        raise ValueError(f"the Pallas {slot} kernel runs per data-parallel rank; layout {layout.name!r} also splits "
                         f"heads across devices: use layout 'dp_ep' ('dp8_ep8', the 'kernels' stage) or the plan's "
                         f"{field}='xla'")
    specs = jax.tree.map(lambda _: P(ALL), args)
    return jax.shard_map(f, in_specs=specs, out_specs=P(ALL), check_vma=False)(*args)
