"""What the model asks of a layout, and the one-device answer.

The model is written once, for one device. A bound serving plan (`qwen35_lib.plan`) answers two questions for
it, as an object passed down from `forward` / `ragged_forward` (the model never looks a plan up), which also
carries the plan itself (`.plan`: the kernel of each slot, `kernels.for_plan`):

- `moe(cfg, w, x)`: the whole MoE layer (router, routed experts, shared expert) on flat tokens x [N, D] -> [N, D];
  a layout with `takes_valid = True` also takes `valid=` [N] (False: a padding token, routed to no expert);
- `per_rank(cfg, slot, fn, *args)`: `jax.vmap(fn)(*args)` over the leading data-parallel rank axis R of every
  array in `args`, which a layout may run inside a `shard_map` (a Pallas kernel cannot be partitioned by XLA);
- `per_device(fn, x, *shared)`: `fn(x, *shared)` on each device's own rows of x (its leading dim split as the
  data-parallel ranks are), `shared` whole on every device (a layer's stacked weights read in place).

Implementations are frozen dataclasses: hashable, so a jitted function takes them as a static argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax

from qwen35_lib.config import Config
from qwen35_lib.model.moe import local_moe
from qwen35_lib.plan import SINGLE, ServingPlan


class Parallelism(Protocol):
    plan: ServingPlan

    def moe(self, cfg: Config, w: dict, x: jax.Array) -> jax.Array: ...

    def per_rank(self, cfg: Config, slot: str, fn: Callable, *args): ...

    def per_device(self, fn: Callable, x: jax.Array, *shared): ...


@dataclasses.dataclass(frozen=True)
class Local:
    """Everything on one device: the MoE dropless on its own (padding tokens routed nowhere), per-rank calls a
    plain `vmap`. `plan`: the one-device plan (its kernels; unbound: the default backend's)."""

    plan: ServingPlan = SINGLE
    takes_valid = True

    def moe(self, cfg: Config, w: dict, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        return local_moe(cfg, w, x, valid, self.plan)

    def per_rank(self, cfg: Config, slot: str, fn: Callable, *args):
        return jax.vmap(fn)(*args)

    def per_device(self, fn: Callable, x: jax.Array, *shared):
        return fn(x, *shared)


LOCAL = Local()


def check_parallelism(config: Config, parallelism: Parallelism | None) -> Parallelism:
    """`parallelism`, or LOCAL (one device, the platform's default kernels) when None. A multi-device plan runs
    through `qwen35_lib.forward(..., plan=plan)` or `parallelism=qwen35_lib.parallel.parallelism(bound plan)`."""
    return LOCAL if parallelism is None else parallelism
