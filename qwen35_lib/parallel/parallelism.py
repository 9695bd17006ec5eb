"""A layout's answer to the model (`qwen35_lib.model.parallelism`): how its MoE runs across the mesh and how a
per-rank kernel is called; and `forward` with the config's layout.

    logits = forward(config, weights, token_ids)   # under `with jax.set_mesh(mesh):` for a multi-device layout
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from qwen35_lib.config import Config
from qwen35_lib.model import decoder
from qwen35_lib.model.moe import local_moe, route, shared_expert
from qwen35_lib.model.parallelism import LOCAL, Parallelism
from qwen35_lib.parallel import ranks, routing
from qwen35_lib.plan import ServingPlan, plan_of


@dataclasses.dataclass(frozen=True)
class MeshParallelism:
    """A multi-device plan on the context mesh (`jax.set_mesh`): the MoE as a `shard_map` of its mode
    (`tp`: expert FFN split + all-reduce; `ep`: experts split, tokens routed as the plan says)."""

    layout: ServingPlan

    def moe(self, cfg: Config, w: dict, x: jax.Array) -> jax.Array:
        if self.layout.moe == "local":
            return local_moe(cfg, w, x)
        if jax.sharding.get_abstract_mesh().empty:
            raise ValueError(f"layout {self.layout.name!r} runs on a mesh: call it under `with jax.set_mesh(mesh):` "
                             "with mesh = qwen35_lib.plan.make_mesh() (the Engine does this when given mesh=...)")
        if self.layout.moe == "ep":
            return routing.moe_ep(cfg, w, x, route, self.layout)[0] + shared_expert(w, x)
        weights, ids = route(cfg, w["router"], x)
        return routing.moe_tp(cfg, w, x, ids, weights, shared_expert, self.layout)

    def per_rank(self, cfg: Config, slot: str, fn: Callable, *args):
        return ranks.per_rank(cfg, slot, fn, *args, plan=self.layout)


def parallelism(config: Config) -> Parallelism:
    """The parallelism of the config's plan (`plan_of`: layout, routing, flags; LOCAL for `single`)."""
    plan = plan_of(config)
    return LOCAL if plan.name == "single" else MeshParallelism(plan)


def _placed(config: Config) -> Config:
    """The config as placed on the context mesh (`tp_kvrep`: the duplicated KV heads `shard_weights` made)."""
    mesh = jax.sharding.get_abstract_mesh()
    plan = plan_of(config)
    return config if mesh.empty or plan.name == "single" else plan.placed_config(config, mesh)


def forward(config: Config, weights: dict, token_ids, lengths=None) -> jax.Array:
    """`model.forward` under the config's layout: float32 logits [B, T, V] for right-padded rows [B, T] (weights
    placed by `shard_weights`)."""
    return decoder.forward(_placed(config), weights, token_ids, lengths, parallelism(config))


def lower_forward(config: Config, weights: dict, token_ids, lengths) -> jax.stages.Lowered:
    """`model.decoder.lower_forward` under the config's layout (for ahead-of-time compiles)."""
    return decoder.lower_forward(_placed(config), weights, token_ids, lengths, parallelism(config))
