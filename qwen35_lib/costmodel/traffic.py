"""The collectives and resident bytes of one engine step under a serving plan, in closed form (never read from HLO).

`step_collectives(plan, config, shape, backend)` lists the collectives one device runs in the engine's step
(`engine.engine_step`: embedding, the scan over layer groups, LM head, sampling) as `Op`s; `collective_counts` sums
them per kind, `{kind: (count, bytes)}` per device per step; the time model (`step.step_time`) prices these same
ops. Bytes follow the convention of each kind (`parallel.hlo.MOVED`, what `hlo.step_counts` reads from a compile):
all-gather the output, reduce-scatter the input, all-reduce, all-to-all and collective-permute the operand.

Per device: n devices (`chips` x `cores`), R data-parallel ranks (`plan.dp`) of T tokens and S sequence rows each,
N = R·T tokens in the step (N_p: padded to a multiple of n for the EP MoE), L layers, D hidden, k experts a token,
V vocab, b the wire item size of the model dtype (XLA:CPU widens 16-bit float collectives to float32: b = 4 on
backend "cpu"):

| plan               | where      | op (runs)                                           | bytes each           |
|--------------------|------------|-----------------------------------------------------|----------------------|
| TP (`tp*`)         | embedding  | all-reduce of the vocab-split lookup (1)            | N·D·b                |
|                    | each layer | all-reduce after the mixer (L) and the MoE (L)      | N·D·b                |
|                    | logits     | all-gather of the vocab-split logits (1)            | R·S·V·4              |
| EP + replicate     | each layer | all-gather hidden (L)                               | N_p·D·b              |
|                    |            | ids (L) + weights (L); fused: one packed (L)        | N_p·k·4, N_p·k·b; N_p·2k·4 |
|                    |            | reduce-scatter (L)                                  | N_p·D·b              |
|                    |            | hierarchical, m micro-batches: over core (m·L)      | N_p·D·b / m          |
|                    |            | then over chip (m·L)                                | N_p·D·b / (m·cores)  |
| EP + all_to_all    | each layer | dispatch, packed ids+weights, return (3L)           | n·c·D·b, n·c·2k·4, n·c·D·b |
| `tp_ep` + replicate| as TP      | as TP (local experts + shared slice, one all-reduce)| N·D·b                |
| `tp_ep` + a2a      | as TP      | + EP + all_to_all's rows, routed output AG (L)      | N_p·D·b              |
| `dp_tp2_ep`        | each layer | EP rows of N = R·T, the reduce-scatter an all-reduce| N_p·D·b              |
|                    |            | over a chip's cores (group 2): all-gather of the    |                      |
|                    |            | rank's tokens before the mixer (L) and the MoE (L)  | T·D·b                |
|                    |            | all-reduce after the mixer (L), of the shared       |                      |
|                    |            | expert's slices (L)                                 | T·D·b                |
|                    | attention  | all-gather of RoPE's cos and sin (2 a layer)        | T·rotary·4           |
|                    | embedding  | all-reduce of the vocab-split lookup (1, cores)     | T·D·b                |
|                    | sampling   | sampled rows over the cores: pred (1), int32 (1)    | 512⌈S/512⌉, 16·S     |
| ranks over devices | sampling   | all-reduce "every row greedy" (1), pred             | 1                    |
|                    |            | all-gather of the next tokens (1; TPU: all-reduce)  | R·S·4                |

(c = `routing.a2a_cap` rows per destination: N_p / n dropless; m = `plan.rs_slices`, the count the code runs.)
`resident_bytes` gives the weights and caches one device holds: every declared array's bytes over the ways the
plan's rules split it (`parallel.shardings.spec` on the plan's mesh sizes; `tp_kvrep`'s duplicated KV heads
included).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from qwen35_lib.config import Config
from qwen35_lib.engine.cache import CacheShape, declare_cache
from qwen35_lib.parallel.routing import a2a_cap
from qwen35_lib.parallel.shardings import spec
from qwen35_lib.plan import ALL, AXES, ServingPlan
from qwen35_lib.weights import declare, declare_mtp, is_info, mtp_layer_config

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class StepShape:
    """A compiled engine step, per data-parallel rank: T packed tokens (decode region + prefill region, as
    `aot.compile_step` lays them out) and S sequence rows (the logits and sampling rows)."""

    tokens: float
    seqs: float

    @classmethod
    def of_compile(cls, config: Config, ranks: int, requests: int, decode: int, prefill: int = 0) -> StepShape:
        """The shape `aot.compile_step(requests=, decode=, prefill=)` compiles on `ranks` ranks."""
        C = config.gdn_chunk_size
        return cls(tokens=decode + -(-prefill // C) * C, seqs=-(-requests // ranks))


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # one of KINDS
    bytes: float  # per device, by the kind's convention (module doc)
    runs: int  # times it runs per step
    group: int  # devices in its group
    part: str  # "embed" | "mixer" | "moe" | "moe_rs_core" | "moe_rs_chip" | "logits" | "sample"
    over: str = "all"  # the devices of its group: "all" (a flat ring through every device) | "core" (one chip's)


def wire_itemsize(dtype: str, backend: str) -> int:
    """Bytes a collective moves per element of `dtype` on `backend` (XLA:CPU runs 16-bit floats as float32)."""
    size = jnp.dtype(dtype).itemsize
    return 4 if backend == "cpu" and size == 2 and jnp.issubdtype(jnp.dtype(dtype), jnp.floating) else size


def sizes(plan: ServingPlan) -> tuple[int, int, int]:
    """(devices, chips, cores) of the mesh the bound `plan` is bound to."""
    if plan.mesh_shape is None:
        raise ValueError(f"plan {plan.name!r} has no mesh: bind it first (plan.bind(mesh))")
    shape = dict(plan.mesh_shape)
    return math.prod(shape.values()), shape.get("chip", 1), shape.get("core", 1)


def step_collectives(plan: ServingPlan, config: Config, shape: StepShape, backend: str = "tpu") -> list[Op]:
    """The collectives of one engine step on one device (the module doc's table)."""
    n, chips, cores = sizes(plan)
    if plan.layout == "single" or n == 1:
        return []
    D, L = config.hidden_size, config.num_layers
    b = wire_itemsize(config.dtype, backend)
    R = plan.dp
    N = R * shape.tokens
    out: list[Op] = []
    logits = Op("all-gather", R * shape.seqs * config.vocab_size * 4, 1, n, "logits")
    if plan.moe == "tp" or (plan.moe == "ep" and plan.batch_axes is None and plan.routing != "all_to_all"):
        # tp, tp_kvrep; tp_ep + replicate: local experts on every token and the shared expert's slice, one all-reduce
        return [Op("all-reduce", N * D * b, 1, n, "embed"), Op("all-reduce", N * D * b, L, n, "mixer"),
                Op("all-reduce", N * D * b, L, n, "moe"), logits]
    if plan.moe == "ep" and plan.batch_axes is None:  # tp_ep + all_to_all: from each device's 1/n of the tokens
        Np = N + (-N % n)
        return [Op("all-reduce", N * D * b, 1, n, "embed"), Op("all-reduce", N * D * b, L, n, "mixer"),
                *(dataclasses.replace(op, runs=op.runs * L) for op in moe_layer_ops(plan, config, N, backend)),
                Op("all-gather", Np * D * b, L, n, "moe"),  # the routed output back on every device
                Op("all-reduce", N * D * b, L, n, "moe"), logits]  # the shared expert's F/n slices
    if plan.moe != "ep" or plan.batch_axes not in (ALL, "chip"):
        raise ValueError(f"no closed form for the collectives of layout {plan.layout!r}: the cost model covers the "
                         "TP layouts, tp_ep, dp_tp2_ep and dp_ep")
    ep_ops = moe_layer_ops(plan, config, N, backend)
    if plan.batch_axes == "chip":  # dp_tp2_ep: heads over the cores of a chip, a rank's T tokens split between them
        T, S, n_attn = shape.tokens, shape.seqs, config.layer_types.count("full_attention")
        out += [Op("all-reduce", T * D * b, 1, cores, "embed", "core"),  # the vocab-split lookup's partial sums
                Op("all-gather", T * D * b, L, cores, "mixer", "core"),  # the rank's tokens on both cores
                Op("all-gather", T * config.rotary_dim * 4, 2 * n_attn, cores, "mixer", "core"),  # RoPE cos, sin
                Op("all-reduce", T * D * b, L, cores, "mixer", "core"),  # the heads' partial sums
                Op("all-gather", T * D * b, L, cores, "moe", "core"),  # the rank's tokens again, for the MoE
                Op("all-reduce", T * D * b, L, cores, "moe", "core"),  # the shared expert's F/2 slices
                # the sampled rows, half on each core, joined as zero-padded all-reduces: a pred [S] (XLA:TPU pads
                # it to 512 bytes) and four int32 [S] in one op
                Op("all-reduce", -(-S // 512) * 512, 1, cores, "sample", "core"),
                Op("all-reduce", 4 * S * 4, 1, cores, "sample", "core")]
        # the routed output's reduce-scatter over every device and the all-gather of the rank's rows over the chip's
        # cores that its layout then needs compile as one all-reduce over every device (the TPU7x compile)
        ep_ops = [dataclasses.replace(op, kind="all-reduce") if op.kind == "reduce-scatter" and op.part == "moe"
                  else op for op in ep_ops]
    out += [dataclasses.replace(op, runs=op.runs * L) for op in ep_ops]
    if R > 1:  # XLA:TPU runs the next tokens' all-gather as an all-reduce of the zero-padded [R, S] (the compile)
        gather = "all-reduce" if backend == "tpu" else "all-gather"
        out += [Op("all-reduce", 1, 1, n, "sample"), Op(gather, R * shape.seqs * 4, 1, n, "sample")]
    return out


def moe_layer_ops(plan: ServingPlan, config: Config, tokens: float, backend: str = "tpu") -> list[Op]:
    """The collectives of one EP MoE layer on one device (the module doc's EP rows, `runs` per layer), with
    `tokens` in the step over all ranks (N; padded to N_p, a multiple of the devices)."""
    n, chips, cores = sizes(plan)
    if plan.moe != "ep":
        raise ValueError(f"layout {plan.layout!r} has no expert-parallel MoE layer: use an EP layout (dp8_ep8)")
    D, k = config.hidden_size, config.num_experts_per_tok
    b = wire_itemsize(config.dtype, backend)
    Np = tokens + (-tokens % n)
    if plan.routing == "all_to_all":
        cap = a2a_cap(config, plan, Np // n, n)
        return [Op("all-to-all", n * cap * D * b, 1, n, "moe"), Op("all-to-all", n * cap * 2 * k * 4, 1, n, "moe"),
                Op("all-to-all", n * cap * D * b, 1, n, "moe")]
    out = [Op("all-gather", Np * D * b, 1, n, "moe")]
    out += [Op("all-gather", Np * 2 * k * 4, 1, n, "moe")] if plan.fuse_allgather else \
        [Op("all-gather", Np * k * 4, 1, n, "moe"), Op("all-gather", Np * k * b, 1, n, "moe")]
    if plan.fused_combine:  # the rows go home by remote DMA from the grouped-matmul kernel (`costmodel.fused_combine`)
        return out
    if plan.hierarchical_rs:
        m = plan.rs_slices(int(Np), n)
        return out + [Op("reduce-scatter", Np * D * b / m, m, cores, "moe_rs_core"),
                      Op("reduce-scatter", Np * D * b / (m * cores), m, chips, "moe_rs_chip")]
    return out + [Op("reduce-scatter", Np * D * b, 1, n, "moe")]


def layer_bytes(ops: list[Op]) -> dict[str, float]:
    """{kind: bytes per device} of `ops` (e.g. `moe_layer_ops`), each run counted, by the kinds' convention."""
    out: dict[str, float] = {}
    for op in ops:
        out[op.kind] = out.get(op.kind, 0) + op.runs * op.bytes
    return out


def wire_bytes(ops: list[Op]) -> float:
    """Bytes one device puts on (or takes off) its links for `ops`: (g - 1) / g of each op's bytes, g its group
    (an all-gather's or all-to-all's own block, a reduce-scatter's own share of its input, stay)."""
    return sum(op.runs * op.bytes * (op.group - 1) / op.group for op in ops)


def collective_counts(plan: ServingPlan, config: Config, shape: StepShape, backend: str = "tpu"
                      ) -> dict[str, tuple[int, float]]:
    """{kind: (ops run, bytes)} per device for one engine step, every kind of KINDS (zeros included)."""
    out = dict.fromkeys(KINDS, (0, 0.0))
    for op in step_collectives(plan, config, shape, backend):
        c, nbytes = out[op.kind]
        out[op.kind] = (c + op.runs, nbytes + op.runs * op.bytes)
    return out


def per_device(plan: ServingPlan, tree) -> dict[str, int]:
    """{top-level name: bytes one device holds} of a tree of declared arrays under the bound `plan`."""
    _, chips, cores = sizes(plan)
    mesh = AbstractMesh((chips, cores), AXES)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_info)
    out: dict[str, int] = {}
    for path, info in flat:
        split = spec(plan, mesh, info.logical_axes, info.shape)
        ways = math.prod(dict(plan.mesh_shape)[a] for e in split if e is not None
                         for a in ((e,) if isinstance(e, str) else e))
        out[path[0].key] = out.get(path[0].key, 0) + info.nbytes // ways
    return out


def weight_bytes(plan: ServingPlan, config: Config) -> int:
    """Weight bytes one device holds under the bound `plan` (`tp_kvrep`: with its duplicated KV heads)."""
    return sum(per_device(plan, declare(plan.placed(config))).values())


def resident_bytes(plan: ServingPlan, config: Config, cache: CacheShape) -> dict[str, int]:
    """{"weights", "kv", "gdn_state"}: bytes one device holds under the bound `plan` with caches of `cache`. The
    reference of the bytes a device holds: every other computation of them (`aot.sweep.resident`, `placement`,
    `engine.cache.device_cache_bytes`, the compile's `aot.resident_bytes`, `budget`'s experts-sharded weights) is a
    test against this one (tests/integration/test_one_truth.py, tests/aot/test_init.py, tests/test_budget.py)."""
    caches = per_device(plan, declare_cache(plan.placed(config), cache))
    kv = caches.pop("kv", 0) + caches.pop("kv_scale", 0)
    return {"weights": weight_bytes(plan, config), "kv": kv, "gdn_state": sum(caches.values())}


def mtp_resident_bytes(plan: ServingPlan, config: Config, cache: CacheShape) -> dict[str, int]:
    """{"weights", "kv"}: bytes one device holds of the MTP head under the bound `plan` (speculative decoding): its
    weights (`weights.declare_mtp`) and its one-layer KV pool on the main pools' pages (`engine.Engine.head_cache`:
    `cache` at verify 1)."""
    placed = plan.placed(config)
    pool = per_device(plan, declare_cache(mtp_layer_config(placed), dataclasses.replace(cache, verify=1)))
    return {"weights": sum(per_device(plan, declare_mtp(placed)).values()),
            "kv": pool.get("kv", 0) + pool.get("kv_scale", 0)}


__all__ = ["KINDS", "Op", "StepShape", "collective_counts", "layer_bytes", "moe_layer_ops", "mtp_resident_bytes",
           "per_device", "resident_bytes", "sizes", "step_collectives", "weight_bytes", "wire_bytes", "wire_itemsize"]
