"""A plan's answer to the model (`qwen35_lib.model.parallelism`): how its MoE runs across the mesh and how a
per-rank kernel is called; and `forward` under a serving plan.

    logits = forward(config, weights, token_ids, plan=plan)   # under `with jax.set_mesh(mesh):` on many devices
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from qwen35_lib.config import Config
from qwen35_lib.model import decoder
from qwen35_lib.model.moe import local_moe, route, shared_expert
from qwen35_lib.model.parallelism import LOCAL, Local, Parallelism
from qwen35_lib.parallel import ranks, routing
from qwen35_lib.plan import SINGLE, ServingPlan


@dataclasses.dataclass(frozen=True)
class MeshParallelism:
    """A multi-device plan on the context mesh (`jax.set_mesh`): the MoE as a `shard_map` of its mode
    (`tp`: expert FFN split + all-reduce; `ep`: experts split, tokens routed as the plan says; `ep` with every token
    on every device, `tp_ep`: local experts on all tokens + all-reduce, or all_to_all from each device's 1/n)."""

    plan: ServingPlan

    def moe(self, cfg: Config, w: dict, x: jax.Array) -> jax.Array:
        if self.plan.moe == "local":
            return local_moe(cfg, w, x, plan=self.plan)
        if jax.sharding.get_abstract_mesh().empty:
            raise ValueError(f"plan {self.plan.name!r} runs on a mesh: call it under `with jax.set_mesh(mesh):` "
                             "with mesh = qwen35_lib.plan.make_mesh() (the Engine does this when given mesh=...)")
        if self.plan.moe == "ep" and self.plan.batch_axes is None and self.plan.routing != "all_to_all":
            weights, ids = route(cfg, w["router"], x)  # tp_ep: every token on every device, routed everywhere
            return routing.moe_ep_everywhere(cfg, w, x, ids, weights, shared_expert, self.plan)
        if self.plan.moe == "ep":
            if self.plan.batch_axes is None:  # tp_ep + all_to_all: the tokens stay on every device around the
                # routing (a slice in, an all-gather out), else XLA carries its token split into the mixers
                x = jax.lax.with_sharding_constraint(x, P())
                y = jax.lax.with_sharding_constraint(routing.moe_ep(cfg, w, x, route, self.plan)[0], P())
                return y + shared_expert(w, x)
            return routing.moe_ep(cfg, w, x, route, self.plan)[0] + shared_expert(w, x)
        weights, ids = route(cfg, w["router"], x)
        return routing.moe_tp(cfg, w, x, ids, weights, shared_expert, self.plan)

    def per_rank(self, cfg: Config, slot: str, fn: Callable, *args):
        return ranks.per_rank(cfg, slot, fn, *args, plan=self.plan)

    def per_device(self, fn: Callable, x: jax.Array, *shared):
        return ranks.per_device(fn, x, *shared, plan=self.plan)


def parallelism(plan: ServingPlan) -> Parallelism:
    """The parallelism of a bound `plan`: `Local` on one device (the plan's kernels), else `MeshParallelism`."""
    if plan.layout == "single":
        return LOCAL if plan is SINGLE else Local(plan)
    return MeshParallelism(plan)


def _bound(config: Config, plan: ServingPlan | None) -> tuple[Config, ServingPlan]:
    """(the config as placed, the plan bound to the context mesh): `plan` as given when bound already."""
    plan = SINGLE if plan is None else plan
    mesh = jax.sharding.get_abstract_mesh()
    plan = plan.bound(None if mesh.empty or plan.layout == "single" else mesh, config)  # the context mesh
    return plan.placed(config), plan


def forward(config: Config, weights: dict, token_ids, lengths=None, plan: ServingPlan | None = None) -> jax.Array:
    """`model.forward` under the serving `plan` (default: one device): float32 logits [B, T, V] for right-padded
    rows [B, T] (weights placed by `shard_weights`; a multi-device plan runs under `with jax.set_mesh(mesh):`, and
    an unbound one is bound to that mesh here)."""
    config, plan = _bound(config, plan)
    return decoder.forward(config, weights, token_ids, lengths, parallelism(plan))


def lower_forward(config: Config, weights: dict, token_ids, lengths, plan: ServingPlan | None = None
                  ) -> jax.stages.Lowered:
    """`model.decoder.lower_forward` under the serving `plan` (for ahead-of-time compiles)."""
    config, plan = _bound(config, plan)
    return decoder.lower_forward(config, weights, token_ids, lengths, parallelism(plan))
