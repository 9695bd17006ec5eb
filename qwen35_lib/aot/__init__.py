"""Ahead-of-time compiles for TPU7x on any machine: the `tpu7x:2x2x1` topology (libtpu, the `tpu` extra).

`get_topology_desc` describes the 8 TensorCores of a TPU7x-8 (4 chips x 2 cores) without a TPU; programs
lowered against them with `jax.ShapeDtypeStruct` inputs compile for real (Mosaic included) and allocate
nothing, so per-device memory (`memory_analysis()`), FLOPs and bytes (`cost_analysis()`) and the compiled
collectives can be read at the full 397B size. Each compile takes `(config, plan, mesh)` and binds the plan to
the mesh once (its kernel slots resolved for the TPU: Pallas kernels lower for Mosaic, not for the interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from qwen35_lib.config import Config
from qwen35_lib.plan import SINGLE, BoundPlan, ServingPlan
from qwen35_lib.weights import abstract_weights

TPU7X_8 = "tpu7x:2x2x1"
# The XLA flags the public Ironwood (TPU7x) Qwen3.5 serving recipe sets: no merging of async collectives (the
# hierarchical reduce-scatter's micro-batches stay separate, so their phases can overlap) and no all-reduce-
# scatter combining. Pass as `compile_step(..., compiler_options=RECIPE_OPTIONS)` (or `sweep --recipe`).
RECIPE_OPTIONS = {"xla_tpu_enable_async_collective_merger": "false", "xla_tpu_ars_combiner_threshold_in_bytes": "0"}


@functools.lru_cache(maxsize=4)
def topology_devices(topology: str = TPU7X_8) -> tuple:
    """The devices of a TPU topology description (needs libtpu: `pip install 'qwen35-playbook[tpu]'`)."""
    # libtpu takes /tmp/libtpu_lockfile for the whole process; without this, a second process (a notebook
    # kernel next to a test run) cannot load it. Nothing here drives a real TPU, so sharing is safe.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):  # no TPU here: quiet libtpu's probing
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    from jax.experimental import topologies

    try:
        return tuple(topologies.get_topology_desc(topology, "tpu").devices)
    except Exception as e:  # libtpu missing or the name unknown
        raise RuntimeError(f"cannot describe TPU topology {topology!r} ({e}); ahead-of-time TPU compiles need "
                           "libtpu: pip install 'jax[tpu]' (the project's 'tpu' extra)") from e


def chip_core_mesh(devices=None) -> Mesh:
    """The playbook's `('chip', 'core')` mesh over TPU devices (default: the tpu7x:2x2x1 description), ordered
    chip-major, core-minor by physical coordinates."""
    from qwen35_lib.plan import make_mesh

    return make_mesh(topology_devices() if devices is None else devices)


def compile_forward(config: Config, batch: int, seq: int, topology: str = TPU7X_8, plan: ServingPlan = SINGLE):
    """`forward` compiled for one device of `topology` with abstract weights under the one-device `plan` (its
    kernels resolved for the TPU); returns the compiled executable."""
    from qwen35_lib.parallel.parallelism import lower_forward

    device = topology_devices(topology)[0]
    plan = plan.bound(None, config, platform=device.platform)
    one = jax.sharding.SingleDeviceSharding(device)
    weights = abstract_weights(config, jax.tree.map(lambda _: one, abstract_weights(config)))
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=one)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=one)
    return lower_forward(config, weights, ids, lengths, plan).compile()


PALLAS_TILE = (8, 128)  # the tiles XLA hands a Mosaic call its bf16 operands in


def mxu_format(a: jax.ShapeDtypeStruct, hidden: int | None = None, tile: tuple[int, int] = (16, 128)
               ) -> jax.ShapeDtypeStruct:
    """`a` (a sharded abstract weight) in bf16's native TPU tiling, 16 x 128 (two rows packed per 32-bit word),
    when it is bf16 of rank >= 2 with its second-minor dim a multiple of 16; else unchanged. A stacked input
    projection [G, L, D, a, b] (`hidden` = D: GDN w_q / w_k / w_v / w_z, attention q / gate / k / v) is stored
    [G, L, a, D, b] (D second-minor), the order the layer loop's dot reads a group's slice in. (The shared
    expert's gate_up [G, L, D, 2, F] is left as declared, its second-minor 2 failing the check: the loop still
    relayouts each group's slice of it, 2 x 64 MiB at 397B width.)

    Measured (kernels stage, decode, TPU7x, tests/integration/test_tpu_in_place.py): in the default layout (8 x 128) XLA
    relayouts whole stacked output projections (GDN w_out, attention w_o, the shared expert's down) before the
    layer loop, a temporary that grows with depth; in 16 x 128 alone the loop still copies each group's slice of
    the input projections into the D-second-minor order (2 x 192 MiB for w_v and w_z at 397B width) and the
    heap packs those copies differently at 2 groups than at 3 (temporaries 1.134 / 1.439 / 1.457 GB at 2 / 3 / 15
    groups); stored D-second-minor, the copies go (0.967 GB at 2 and at 3 groups; with the FP8 scales placed by
    `scale_format` too, 0.964 / 0.963 / 0.962 GB at 2 / 3 / 15 groups). (The caches cannot be placed so: XLA
    overrides a 16 x 128 GDN or conv state with 8 x 128, the layout the step returns them in.) A weight split over
    the mesh is left as it is: under the TP baseline XLA keeps its own 8 x 128 tiling for the vocabulary-split
    embedding and the head-split projections, and jax then refuses the compiled step (an AssertionError on the
    layout override). Every EP stage replicates its bf16 weights, so this changes none of them.

    `tile`: (8, 128) for the stacks a Pallas kernel reads in place (`kernels.dense.pallas`, `dense_format`): XLA
    hands a Mosaic call its operands in 8 x 128 tiles, so stacks in 16 x 128 were relaid out whole before the loop
    (each one whose minor dim is not 128: 16 x 128 and 8 x 128 tiles of a 128-wide bf16 row are the same bytes),
    while the in-projections' D-second-minor order makes the kernel's [A, D, N] view a bitcast."""
    order = tuple(range(a.ndim))
    if hidden and a.ndim == 5 and a.shape[2] == hidden:
        order = (0, 1, 3, 2, 4)  # [G, L, D, a, b] stored [G, L, a, D, b]: D second-minor, as the dot reads it
    # the dim the tiles' rows run over: as stored for a Pallas read (the shared expert's gate_up [G, L, D, 2, F]
    # stored [G, L, 2, D, F]: else XLA relaid the whole stack out before the loop every step, 0.5 GB of temporaries
    # at 397B); for XLA's dot as declared (that gate_up left as it is)
    if jnp.dtype(a.dtype) != jnp.bfloat16 or a.ndim < 2:
        return a
    if (a.shape[order[-2]] if tile == PALLAS_TILE else a.shape[-2]) % tile[0]:
        return a
    if any(s is not None for s in getattr(a.sharding, "spec", ())):
        return a  # split (a TP layout's): XLA overrides the tiling asked for and jax refuses the compiled step
    from jax.experimental.layout import Format, Layout

    layout = Layout(major_to_minor=order, tiling=(tile, (2, 1)))
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=Format(layout, a.sharding))


def dense_format(weights: dict, declared: dict, config: Config, plan: ServingPlan) -> dict:
    """`weights` (placed by `mxu_format`) with the dense projection stacks the plan's `dense` kernel reads in place
    (`model.layer_loop.STACKED_DENSE`, where it reads stacks) placed from their `declared` form in 8 x 128 tiles
    instead (`mxu_format`'s `tile`), as the Mosaic call takes them."""
    from qwen35_lib.kernels import for_plan
    from qwen35_lib.model.layer_loop import STACKED_DENSE

    if not getattr(for_plan("dense", plan), "reads_stacked", False):
        return weights
    layers = dict(weights["layers"])
    for part, names in STACKED_DENSE.items():
        if part in layers:
            layers[part] = dict(layers[part], **{n: mxu_format(declared["layers"][part][n], config.hidden_size,
                                                               tile=PALLAS_TILE) for n in names})
    return dict(weights, layers=layers)


def scale_format(a: jax.ShapeDtypeStruct, name: str) -> jax.ShapeDtypeStruct:
    """A stacked FP8 expert weight's f32 block scales (`name`: "w_gate_up" [G, L, E, D/128, 2, F/128] or "w_down"
    [G, L, E, F/128, D/128]) in the layout the Pallas grouped matmul reads each layer's slice in (gate_up: row-major
    in 2 x 128 tiles; down: its last two dims swapped, 8 x 128 tiles). In the compiler's default parameter layout
    XLA relayouts the whole stack before the layer loop every step, a temporary that grows with depth (22.5 MiB at
    15 groups of the reduced 397B step in tests/integration/test_tpu_in_place.py)."""
    from jax.experimental.layout import Format, Layout

    order, tile = (tuple(range(a.ndim)), (2, 128)) if name == "w_gate_up" else \
        ((*range(a.ndim - 2), a.ndim - 1, a.ndim - 2), (8, 128))
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=Format(Layout(major_to_minor=order, tiling=(tile,)),
                                                                  a.sharding))


def serving_pools(plan: BoundPlan, requests: int, context_len: int, page_size: int, verify: int = 1):
    """The engine's `CacheShape` for `requests` sequences of `context_len` tokens under the bound `plan` (what the
    compiles and the sweep give the step): `CacheShape.for_requests` over the plan's data-parallel ranks, the KV
    dtype it is bound with, stored as its attention asks (`engine.cache.kv_words_for`: uint32 words for the XLA
    attention on a TPU); `verify` > 1: with speculative verification's checkpoints (`CacheShape.verify`)."""
    from qwen35_lib.engine.cache import CacheShape, kv_words_for

    shape = CacheShape.for_requests(requests, context_len, ranks=plan.dp, page_size=page_size, kv_dtype=plan.kv_dtype,
                                    kv_words=kv_words_for(plan))
    return dataclasses.replace(shape, verify=verify) if verify > 1 else shape


def compile_step(config: Config, plan: ServingPlan, mesh: Mesh, *, requests: int, context_len: int, decode: int,
                 prefill: int = 0, page_size: int = 16, kv_dtype: str | None = None,
                 compiler_options: dict | None = None, weight_layouts: str = "default", speculative_tokens: int = 0):
    """The engine's jitted step under the serving `plan` (bound here to `mesh`, e.g. `chip_core_mesh()` for
    TPU7x-8, and checked against `config`), lowered with abstract weights, caches and inputs and compiled;
    nothing is allocated.

    requests: concurrent sequences (pools sized for `requests` of `context_len` tokens, spread over the
    layout's data-parallel ranks); decode / prefill: tokens per rank in this step (decode region, then a
    prefill region rounded up to whole GDN chunks); compiler_options: XLA options for this compile (e.g.
    {"xla_tpu_enable_async_collective_merger": "false"}); weight_layouts: "default" (each weight in the
    device's default layout, as `jax.device_put` leaves it) or "mxu" (`mxu_format`: bf16 weights tiled and
    ordered as the step's dots read them); speculative_tokens k > 0: the engine's verify step instead
    (`engine.step.verify_step`: decode rows of k + 1 tokens, `decode` rows a rank, every sequence's logits at its
    k + 1 tokens, the GDN pools with their verification checkpoints, `CacheShape.verify`). Returns the compiled
    executable.
    """
    from qwen35_lib.engine.batch import RaggedMeta
    from qwen35_lib.engine.cache import abstract_cache
    from qwen35_lib.engine.step import engine_step, verify_step
    from qwen35_lib.parallel.shardings import batch_sharding, weight_shardings

    plan = plan.bound(mesh, config, kv_dtype=kv_dtype)  # the KV dtype: the plan's, else `kv_dtype`
    config = plan.placed(config)  # tp_kvrep: the duplicated KV heads the weights and cache carry
    R = plan.dp
    V = speculative_tokens + 1  # tokens a decode row holds: its last token and its drafts
    shape = serving_pools(plan, requests, context_len, page_size, V)
    S = shape.seqs_per_rank
    pages = -(-context_len // page_size)  # a sequence's page-table row
    C = config.gdn_chunk_size
    D = max(decode, 1)  # the decode region: at least one slot, as the engine forms its steps (`Engine.step_shape`)
    T = D * V + -(-prefill // C) * C
    weights = abstract_weights(config, weight_shardings(config, plan, mesh))
    if weight_layouts == "mxu":
        weights = dense_format(jax.tree.map(lambda a: mxu_format(a, config.hidden_size), weights), weights, config,
                               plan)
        moe = weights["layers"]["moe"]
        for name in ("w_gate_up", "w_down"):
            if hasattr(moe[name], "scale"):  # block-scaled FP8: the scales as the grouped matmul reads them
                moe[name] = moe[name]._replace(scale=scale_format(moe[name].scale, name))
    elif weight_layouts != "default":
        raise ValueError(f"weight_layouts must be 'default' or 'mxu', got {weight_layouts!r}")
    cache = abstract_cache(config, shape, plan, mesh)
    arr = lambda shp, dt=jnp.int32: jax.ShapeDtypeStruct(shp, dt, sharding=batch_sharding(plan, mesh, len(shp)))
    meta = RaggedMeta(token_seq=arr((R, T)), positions=arr((R, T)), q_start=arr((R, S)), q_len=arr((R, S)),
                      kv_len=arr((R, S)), page_table=arr((R, S, pages)), slot=arr((R, S)),
                      decode_seq=arr((R, D)), sample_tok=arr((R, S, V) if V > 1 else (R, S)))
    samp = dict(temperature=arr((R, S), jnp.float32), top_k=arr((R, S)), top_p=arr((R, S), jnp.float32),
                seed=arr((R, S), jnp.uint32), position=arr((R, S)))
    if V > 1:  # the verify step's sampling also reads min-p (`speculative.verify`)
        samp["min_p"] = arr((R, S), jnp.float32)
    with jax.set_mesh(mesh):
        step = verify_step if V > 1 else engine_step
        lowered = step.lower(config, plan, weights, cache, arr((R, T)), meta, samp)
        return lowered.compile(compiler_options)


def compile_moe_layer(config: Config, plan: ServingPlan, mesh: Mesh, tokens: int,
                      compiler_options: dict | None = None):
    """One EP MoE layer (`parallel.routing.moe_ep` under the EP `plan`, bound here; layer 0 of group 0, the XLA
    grouped matmul) on `mesh` with x [tokens, D] split over the mesh's devices, compiled with abstract weights
    (and `compiler_options`, e.g. a TPU flag): its collectives as XLA emits and schedules them."""
    from jax.sharding import NamedSharding, PartitionSpec

    from qwen35_lib.model.moe import route
    from qwen35_lib.parallel.routing import moe_ep
    from qwen35_lib.parallel.shardings import weight_shardings
    from qwen35_lib.plan import ALL

    plan = plan.replace(moe_kernel="ragged_dot").bound(mesh, config)
    w = abstract_weights(config, weight_shardings(config, plan, mesh))["layers"]["moe"]
    x = jax.ShapeDtypeStruct((tokens, config.hidden_size), jnp.dtype(config.dtype),
                             sharding=NamedSharding(mesh, PartitionSpec(ALL)))
    layer = lambda w, x: moe_ep(config, jax.tree.map(lambda a: a[0, 0], w), x, route, plan)
    with jax.set_mesh(mesh):
        return jax.jit(layer).lower(w, x).compile(compiler_options)


def resident_bytes(config: Config, plan: ServingPlan, cache_shape, mesh: Mesh) -> tuple[int | None, str | None]:
    """Per-device bytes XLA assigns to the weights plus the caches of `cache_shape` (an `engine.cache.CacheShape`)
    under the serving `plan` (bound here) on `mesh` (e.g. `chip_core_mesh()`): (argument bytes, None) from
    `memory_analysis()` of a program that keeps every input, or (None, the compiler's refusal, e.g.
    RESOURCE_EXHAUSTED)."""
    from qwen35_lib.engine.cache import abstract_cache
    from qwen35_lib.parallel.shardings import weight_shardings

    plan = plan.bound(mesh, config)
    config = plan.placed(config)
    weights = abstract_weights(config, weight_shardings(config, plan, mesh))
    return argument_bytes(weights, abstract_cache(config, cache_shape, plan, mesh))


def argument_bytes(weights: dict, *more) -> tuple[int | None, str | None]:
    """Per-device bytes XLA assigns to abstract `weights` (and the trees of `more`, e.g. caches), each leaf with its
    sharding: (argument bytes, None) from `memory_analysis()` of a program that keeps every input, or (None, the
    compiler's refusal, e.g. RESOURCE_EXHAUSTED). Nothing is allocated."""
    touch = jax.jit(lambda w, *rest: w["final_norm"].astype(jnp.float32).sum(), keep_unused=True)
    try:
        return touch.lower(weights, *more).compile().memory_analysis().argument_size_in_bytes, None
    except jax.errors.JaxRuntimeError as e:
        return None, str(e).splitlines()[0]


HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "f8e4m3fn", "float16": "f16", "int32": "s32",
              "uint32": "u32"}


def cache_pools(config: Config, plan: ServingPlan, mesh: Mesh, shape) -> dict:
    """{cache leaf: `hlo_checks.PoolOf`}: each pool of `engine.cache.declare_cache(config, shape)` as one device
    holds it under the bound `plan` on `mesh` (its rows' dims split as the plan splits them), for
    `hlo_checks.cache_pool_copies`."""
    from qwen35_lib.aot.hlo_checks import PoolOf
    from qwen35_lib.engine.cache import abstract_cache

    out = {}
    for name, a in abstract_cache(config, shape, plan, mesh).items():  # each pool with its own sharding, by name
        local = a.sharding.shard_shape(a.shape)  # [R, L, X, *row]
        out[name] = PoolOf(HLO_DTYPES[jnp.dtype(a.dtype).name], tuple(local[3:]), local[2])
    return out
