"""The sparse MoE block: router, routed SwiGLU experts (dropless), and the gated shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.config import Config
from qwen35_lib.kernels import for_plan
from qwen35_lib.kernels.stacked import LayerOf, layer_index
from qwen35_lib.model.layers import linear
from qwen35_lib.plan import SINGLE, ServingPlan
from qwen35_lib.weights import BlockFP8, dequantize_fp8


def route(cfg: Config, router: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """softmax over all experts (float32) -> top-k -> renormalise. x: [N, D] -> (weights [N, k], ids [N, k])."""
    logits = linear(x, router)  # [N, E] in x's dtype, as HF
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids


def shared_expert(w: dict, x: jax.Array) -> jax.Array:
    """sigmoid(x · shared_gate) * SwiGLU(x). x: [N, D] -> [N, D]."""
    h = linear(x, w["shared_gate_up"]).astype(jnp.float32)  # [N, 2, Fs]
    a = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x.dtype)
    gate = jax.nn.sigmoid(linear(x, w["shared_gate"][:, None]).astype(jnp.float32))  # [N, 1]
    return (gate * linear(a, w["shared_down"]).astype(jnp.float32)).astype(x.dtype)


def routed_experts(cfg: Config, w: dict, x: jax.Array, weights: jax.Array, ids: jax.Array,
                   valid: jax.Array | None = None, plan: ServingPlan = SINGLE) -> jax.Array:
    """Σ_j weights_j * expert_{ids_j}(x), dropless: dispatch (sort copies by expert), grouped matmul, combine.

    The kernels (`moe_matmul`, `permute`) are the ones `plan` names. Tokens not `valid` [N] (padding) are routed to
    no expert: their copies go to a trailing group E that the grouped matmul never computes (rows past the sum of
    the group sizes), so they take no expert's capacity; their routed output is 0.
    An implementation with `fuses(copies, E)` true at this size does all three in one (`fused`), without the sorted
    copies of the rows: the CPU's `native` kernel at every size, `moe.xla.moe_loop` where it loops (prefill sizes).
    """
    E = cfg.num_experts
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, E)  # [N, k]
        weights = jnp.where(valid[:, None], weights, 0)
    matmul = for_plan("moe_matmul", plan)
    if getattr(matmul, "fuses", lambda *_: False)(ids.size, E):  # dispatch and combine inside the grouped matmul
        return matmul.fused(x, ids, weights, E + (valid is not None), w["w_gate_up"], w["w_down"],
                            cfg.fp8_block_size).astype(x.dtype)
    permute = for_plan("permute", plan)
    x_sorted, group_sizes, order = permute.dispatch(x, ids, E + (valid is not None))  # [N*k, D], [E (+1)]
    y_sorted = matmul(x_sorted, group_sizes[:E], w["w_gate_up"], w["w_down"], cfg.fp8_block_size)
    return permute.combine(y_sorted, order, weights).astype(x.dtype)  # [N, D]


def local_moe(cfg: Config, w: dict, x: jax.Array, valid: jax.Array | None = None,
              plan: ServingPlan = SINGLE) -> jax.Array:
    """The MoE layer on one device, flat tokens x: [N, D] -> [N, D]: routed experts (dropless) + shared expert.
    `valid` [N] (optional): False for padding tokens, which are routed to no expert (see `routed_experts`)."""
    weights, ids = route(cfg, w["router"], x)
    return routed_experts(cfg, w, x, weights, ids, valid, plan) + shared_expert(w, x)


def moe_block(cfg: Config, w: dict, x: jax.Array, parallelism, valid: jax.Array | None = None) -> jax.Array:
    """The MoE layer on flat tokens, as the layout runs it (`model.parallelism`). x: [N, D] -> [N, D].
    `valid` [N]: False marks padding tokens; a layout that takes it (`Local`) routes them to no expert."""
    with jax.named_scope("moe"):
        if valid is not None and getattr(parallelism, "takes_valid", False):
            return parallelism.moe(cfg, w, x, valid=valid)
        return parallelism.moe(cfg, w, x)


def moe_dense_reference(cfg: Config, w: dict, x: jax.Array) -> jax.Array:
    """Every expert on every token, masked by the routing weights: the twin the grouped path is tested against."""
    weights, ids = route(cfg, w["router"], x)
    dense = lambda p: dequantize_fp8(p, cfg.fp8_block_size, x.dtype) if isinstance(p, BlockFP8) else p
    h = jnp.einsum("nd,edcf->necf", x, dense(w["w_gate_up"]), preferred_element_type=jnp.float32)
    a = (jax.nn.silu(h[:, :, 0]) * h[:, :, 1]).astype(x.dtype)  # [N, E, F]
    y = jnp.einsum("nef,efd->ned", a, dense(w["w_down"]), preferred_element_type=jnp.float32)
    gate = jnp.zeros((x.shape[0], cfg.num_experts), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(
        weights.astype(jnp.float32))  # [N, E]
    routed = jnp.einsum("ned,ne->nd", y.astype(x.dtype).astype(jnp.float32), gate)
    return routed.astype(x.dtype) + shared_expert(w, x)


EXPERT_WEIGHTS = ("w_gate_up", "w_down")


def stacked_experts(cfg: Config, layers: dict, plan: ServingPlan = SINGLE) -> tuple[dict, dict]:
    """Split the stacked layer tree for the layer scan: (the scan's xs, the expert stacks it must not slice).

    Where the MoE kernel reads stacked weights in place (`reads_stacked`: the Pallas grouped matmul), the routed
    expert weights leave the scanned tree and stay whole; `with_experts` hands each layer a `LayerOf` view of
    them. Elsewhere the tree is scanned as it is ({} kept whole)."""
    if not getattr(for_plan("moe_matmul", plan), "reads_stacked", False):
        return layers, {}
    moe = layers["moe"]
    return (dict(layers, moe={n: v for n, v in moe.items() if n not in EXPERT_WEIGHTS}),
            {n: moe[n] for n in EXPERT_WEIGHTS})


def with_experts(layers: list, stacks: dict, group) -> list:
    """The layers of group `group` (a traced index in the scan) with their expert weights as `LayerOf` views of
    `stacks` (position p in the group: stack[group, p]); unchanged when `stacks` is empty."""
    if not stacks:
        return layers
    return [lw._replace(moe=dict(lw.moe, **{n: LayerOf(s, layer_index(group, p)) for n, s in stacks.items()}))
            for p, lw in enumerate(layers)]
