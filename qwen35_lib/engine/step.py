"""The engine's jitted steps, shared by every engine (one compile per config, bound plan and bucket): the ragged
forward then sampling (`engine_step`), and with drafts to verify (`verify_step`); `rs_row_tile`, the rows a step
must be a multiple of for the plan's MoE to keep its reduce-scatters."""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import PartitionSpec

from qwen35_lib.config import Config
from qwen35_lib.engine.sampling import sample
from qwen35_lib.engine.speculative import replicated, verify
from qwen35_lib.model.ragged import keep_accepted, ragged_forward
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.plan import ServingPlan, axis_size


def rs_row_tile(plan: ServingPlan) -> int:
    """Rows a rank's step must be a multiple of, with a prefill region, for the bound `plan`'s MoE to keep its
    reduce-scatters: 64 where expert parallelism with token replication reduce-scatters each rank's rows over the
    devices, else 1. Read off the TPU7x compiles (libtpu 0.0.42.1): XLA:TPU keeps a reduce-scatter whose blocks
    are whole 8-row tiles on every device and micro-batch; at 64 + 1,024 rows a rank the step keeps its 960, at
    63 + 1,024 or 8 + 1,024 it compiles all-reduces and collective-permutes instead (issues 30 and 50; the
    hierarchical reduce-scatter's 1-8 micro-batches split each device's block further: 64 = 8 rows x 8)."""
    ep_rs = plan.collective_flags_apply and plan.dp > 1  # the plan record's rule: its MoE reduce-scatters the rows
    return 64 if ep_rs else 1


TRACES = [0]  # how many times the step has been traced (compiled), process-wide


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def engine_step(cfg: Config, plan: ServingPlan, weights: dict, cache: dict, tokens, meta, samp):
    """The engine's jitted step, shared by all engines (one compilation per config, bound plan and bucket): the
    ragged forward of every rank's packed tokens [R, T] (`engine.batch`) under the bound `plan`, then sampling.
    Returns (next tokens [R, S], the updated cache, donated). `engine_step.lower(cfg, plan, weights, cache, tokens,
    meta, samp)` with placed or abstract arguments compiles it for a mesh (`qwen35_lib.aot.compile_step`)."""
    TRACES[0] += 1  # runs only while tracing
    logits, cache = ragged_forward(cfg, weights, cache, tokens, meta, parallelism(plan))  # [R, S, V]
    logits = _gathered(cfg, plan, logits)
    R, S, V = logits.shape
    flat = lambda x: x.reshape(R * S)
    # optional keys: callers that lower the step with the older arrays (aot, costmodel.validate) need neither
    proc = jax.tree.map(lambda x: x.reshape(R * S, *x.shape[2:]), samp["proc"]) if "proc" in samp else None
    min_p = flat(samp["min_p"]) if "min_p" in samp else None
    next_tokens = sample(logits.reshape(R * S, V), flat(samp["temperature"]), flat(samp["top_k"]),
                         flat(samp["top_p"]), flat(samp["seed"]), flat(samp["position"]), min_p, proc)
    return replicated(next_tokens.reshape(R, S)), cache


def _gathered(cfg: Config, plan: ServingPlan, logits):
    """Logits [R, ..., V] computed vocab-parallel where the plan splits the vocabulary, then gathered once (vLLM's
    logits gather), split by rank only."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        vocab, inner = plan.axes("vocab"), (None,) * (logits.ndim - 2)
        if vocab is not None and cfg.vocab_size % axis_size(mesh, vocab) == 0:
            logits = jax.lax.with_sharding_constraint(logits, PartitionSpec(plan.batch_axes, *inner, vocab))
        logits = jax.lax.with_sharding_constraint(logits, PartitionSpec(plan.batch_axes))  # [R_x, ..., V]
    return logits


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def verify_step(cfg: Config, plan: ServingPlan, weights: dict, cache: dict, tokens, meta, samp: dict):
    """`engine_step` with drafts to verify (`engine.speculative`): the ragged forward of decode rows of V tokens,
    the target's token after each [R, S, V] and the tokens each row keeps [R, S] (`speculative.verify`: greedy
    acceptance, or speculative sampling with the rows' `samp`), the cache rolled back to them
    (`model.ragged.keep_accepted`) and the normed hidden states [R, T, D] the head drafts from.
    Returns (targets, accepted, cache, hidden)."""
    TRACES[0] += 1  # runs only while tracing
    logits, cache, hidden = ragged_forward(cfg, weights, cache, tokens, meta, parallelism(plan), return_hidden=True)
    targets, accepted = verify(_gathered(cfg, plan, logits), tokens, meta, samp)  # [R, S, V], [R, S]
    return replicated(targets), replicated(accepted), keep_accepted(cache, meta, accepted), hidden
