"""How the decoder walks its layers: a `lax.scan` over the stacked layer groups, or an unrolled Python loop over
per-layer weight leaves. Decided here, once, per backend (`unrolled`).

Why two: XLA:CPU copies every slice of a stacked weight it reads (scan or static index alike), so on the CPU a
decode step of qwen3.5-mini spends most of its time copying weights (an MoE layer at 8 tokens: 8 ms with its
weights as their own arguments, 47 ms sliced inside jit, 62 ms in a scan; `bench engine`). Per-layer leaves,
sliced once outside jit, are read in place. On a TPU the scan's slices are free and it keeps the HLO one group
long (the 60-layer 397B compiles once per group body), so TPU programs and ahead-of-time compiles keep the scan.

The caches follow the weights: where `unrolled`, each pool [R, L, ...] of a kind (`engine.cache`) is split once into
per-layer buffers (`per_layer_cache`), each layer's slot and page updates in-place scatters into its own donated
buffer; the scan keeps one pool a kind and addresses a layer's rows in it, also in place.

One loop body for both forms: `layer_groups` runs a group's body as an unrolled loop or a scan, as the weights
come, and the body reads and writes layer j's pools through `LayerPools` (`get`, `put`, `rows`), whatever theirs.

The scan need not slice what a kernel can read in place: where the plan's MoE kernel reads stacks, the routed
experts stay whole (`model.moe.stacked_experts`); where its `dense` kernel does (`kernels.dense.pallas`, the TPU's
default), so do the projections of `STACKED_DENSE` (`stacked_dense`), each layer handed `LayerOf` views of them
(`with_dense`) that `layers.linear` runs through that kernel on every device's own rows.

Where the native CPU kernels load, the per-layer weights they read are also re-laid for them once, here: the routed
expert stacks and the projections as 64-column panels (the MoE kernel's `pack`, `kernels.dense.pack`), each a
contiguous stream.

Weight forms (`weights["layers"]`):
- stacked (the checkpoint's tree, `weights.abstract_weights`): leaves [G, n, ...] (n layers of a kind per group);
- per-layer (`per_layer_weights`): a tuple of G groups, each a tuple of `len(layer_pattern)` `LayerWeights`.
The model takes either; `prepare_weights` gives the form `unrolled` picks.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qwen35_lib.config import LINEAR, Config
from qwen35_lib.kernels import dense, for_plan
from qwen35_lib.kernels.stacked import LayerOf, layer_index
from qwen35_lib.model.moe import EXPERT_WEIGHTS, stacked_experts, with_experts
from qwen35_lib.plan import SINGLE, ServingPlan

MAX_UNROLLED_LAYERS = 16  # deeper models scan on every backend: an unrolled HLO grows (and compiles) per layer


class LayerWeights(NamedTuple):
    """One layer's weights, each its own array: the mixer's (GDN or attention), the two norms [D], the MoE's."""

    mixer: dict
    input_norm: jax.Array
    post_norm: jax.Array
    moe: dict


def unrolled(cfg: Config, plan: ServingPlan = SINGLE) -> bool:
    """True where the layers run as an unrolled loop over per-layer leaves: XLA:CPU (the platform `plan` is bound
    for; unbound: the default backend), one device (a layout's sharded weights keep their stacked shardings), up to
    MAX_UNROLLED_LAYERS layers."""
    return ((plan.platform or jax.default_backend()) == "cpu" and plan.layout == "single"
            and cfg.num_layers <= MAX_UNROLLED_LAYERS)


def is_per_layer(layers) -> bool:
    return isinstance(layers, tuple)


def group_layers(cfg: Config, w: dict) -> list[LayerWeights]:
    """The layers of one stacked group (leaves [n, ...]), in `layer_pattern` order (slices: used inside a scan)."""
    take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    out, i_gdn, i_attn = [], 0, 0
    for p, kind in enumerate(cfg.layer_pattern):
        if kind == LINEAR:
            mixer, i_gdn = take(w["gdn"], i_gdn), i_gdn + 1
        else:
            mixer, i_attn = take(w["attn"], i_attn), i_attn + 1
        out.append(LayerWeights(mixer, w["input_norm"][p], w["post_norm"][p], take(w["moe"], p)))
    return out


def per_layer_weights(cfg: Config, weights: dict) -> dict:
    """`weights` with its stacked layers split into per-layer leaves (a copy of the layer weights, made once)."""
    layers = weights["layers"]
    if is_per_layer(layers):
        return weights
    return dict(weights, layers=_split(cfg, layers))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _split(cfg: Config, layers: dict, pack=None) -> tuple:
    """Stacked layer leaves [G, n, ...] -> G tuples of LayerWeights (each its own buffer), in one compiled program
    (op by op, every slice and re-layout was a program of its own: ~80 compiles, ~6 s of an engine's start at
    qwen3.5-mini's 4 layers). With `pack` given (the MoE kernel's, or None to leave the experts) the per-layer
    weights are re-laid (`_packed`)."""
    groups = tuple(tuple(group_layers(cfg, jax.tree.map(lambda a, g=g: a[g], layers))) for g in range(cfg.num_groups))
    if pack is None:
        return groups
    return tuple(tuple(_packed(lw, pack) for lw in group) for group in groups)


# the dense projections `linear` reads, by weight name: how many leading dims it contracts
PROJECTIONS = {"w_q": 1, "w_k": 1, "w_v": 1, "w_z": 1, "w_gate": 1, "w_out": 2, "w_o": 2, "router": 1,
               "shared_gate_up": 1, "shared_down": 1}


def _packed(lw: LayerWeights, pack) -> LayerWeights:
    """One layer with its projections re-laid by `kernels.dense.pack` and its routed expert stacks by `pack`
    (each as it was where its handler cannot take it)."""
    projections = lambda tree: {n: dense.pack(a, PROJECTIONS[n]) if n in PROJECTIONS else a for n, a in tree.items()}
    moe = projections(lw.moe)
    return lw._replace(mixer=projections(lw.mixer), moe=dict(moe, **{n: pack(moe[n]) for n in EXPERT_WEIGHTS}))


def _as_is(w):
    return w


def per_layer_cache(cfg: Config, cache: dict, plan: ServingPlan = SINGLE) -> dict:
    """The cache form `unrolled(cfg, plan)` wants: each pool [R, L, ...] of a kind as a tuple of L per-layer arrays
    [R, ...] (copies, made once: call it on a fresh cache), else `cache` as given (one pool a kind, addressed by
    layer rows: `model.ragged`)."""
    if not unrolled(cfg, plan):
        return cache
    return {name: pool if is_per_layer(pool) else _split_pool(pool) for name, pool in cache.items()}


@jax.jit
def _split_pool(a: jax.Array) -> tuple:
    """[R, L, ...] -> L arrays [R, ...], in one dispatch (op by op, the engine's init took ~9 ms)."""
    return tuple(a[:, j] for j in range(a.shape[1]))


# (ids of the stacked leaves and the LM head, pack) -> (weakrefs to them, layer_pattern, (groups, the packed LM head))
_CACHE: dict[tuple, tuple] = {}


def prepare_weights(cfg: Config, weights: dict, plan: ServingPlan = SINGLE) -> dict:
    """The weight form `unrolled(cfg, plan)` wants: per-layer leaves on XLA:CPU (split once per set of stacked arrays
    and remembered while they live), else the stacked tree as given. Abstract or traced weights pass through.
    The per-layer projections are stored as `kernels.dense.pack` lays them (panels where the native library
    loads), and the routed expert stacks in the plan's MoE kernel's where it has a `pack` (the CPU's `native`); so
    is the LM head (`kernels.dense.pack`: decode steps run it on a few rows; XLA's dot read it at about 4.7 GB/s there,
    1.8 ms of a qwen3.5-mini decode step of 8 under the profiler; the handler 0.8 ms)."""
    layers = weights["layers"]
    if is_per_layer(layers) or not unrolled(cfg, plan):
        return weights
    leaves = [*jax.tree.leaves(layers), weights["lm_head"]]
    if any(isinstance(a, (jax.core.Tracer, jax.ShapeDtypeStruct)) for a in leaves):
        return weights
    # the projections are packed whatever the MoE kernel (`linear` reads either form); the experts for a kernel
    # that packs them
    pack = getattr(for_plan("moe_matmul", plan), "pack", _as_is)
    key = (*map(id, leaves), pack)
    hit = _CACHE.get(key)
    if hit is None or hit[1] != cfg.layer_pattern or any(r() is not a for r, a in zip(hit[0], leaves)):
        drop = lambda _: _CACHE.pop(key, None)
        hit = (tuple(weakref.ref(a, drop) for a in leaves), cfg.layer_pattern,
               (_split(cfg, layers, pack), dense.pack(weights["lm_head"])))
        _CACHE[key] = hit
    split, lm_head = hit[2]
    return dict(weights, layers=split, lm_head=lm_head)


# the dense projections a `dense` kernel that reads stacks takes whole (the router stays scanned: the EP MoE's
# shard_map takes it as an argument)
STACKED_DENSE = {"gdn": ("w_q", "w_k", "w_v", "w_z", "w_b", "w_a", "w_out"),
                 "attn": ("w_q", "w_gate", "w_k", "w_v", "w_o"),
                 "moe": ("shared_gate_up", "shared_down")}


def stacked_dense(cfg: Config, layers: dict, plan: ServingPlan = SINGLE) -> tuple[dict, dict]:
    """Split the stacked layer tree for the layer scan: (the scan's xs, the dense projection stacks it must not
    slice). Where the plan's `dense` kernel reads stacks in place (`reads_stacked`: `kernels.dense.pallas`), the
    projections of `STACKED_DENSE` leave the scanned tree and stay whole; `with_dense` hands each layer `LayerOf`
    views of them. Elsewhere the tree is scanned as it is ({} kept whole)."""
    if not getattr(for_plan("dense", plan), "reads_stacked", False):
        return layers, {}
    scanned, stacks = dict(layers), {}
    for part, names in STACKED_DENSE.items():
        if part in layers:
            scanned[part] = {n: a for n, a in layers[part].items() if n not in names}
            stacks[part] = {n: layers[part][n] for n in names}
    return scanned, stacks


def with_dense(cfg: Config, layers: list[LayerWeights], stacks: dict, group, parallelism) -> list[LayerWeights]:
    """The layers of group `group` (a traced index in the scan) with their dense projections as `LayerOf` views of
    `stacks` (a mixer's at its index among the group's layers of its kind, the MoE's at its position), each read by
    the plan's `dense` kernel on every device's own rows (`parallelism.per_device`); unchanged when `stacks` is
    empty."""
    if not stacks:
        return layers
    kernel = for_plan("dense", parallelism.plan)

    def read(x, w, contract, dtype):
        fn = lambda x, stack, index: kernel(x, LayerOf(stack, index), contract, dtype)
        return parallelism.per_device(fn, x, w.stack, w.index)

    view = lambda tree, i: {n: LayerOf(a, layer_index(group, i), read) for n, a in tree.items()}
    out, seen = [], {"gdn": 0, "attn": 0}
    for p, (kind, lw) in enumerate(zip(cfg.layer_pattern, layers)):
        part = "gdn" if kind == LINEAR else "attn"
        mixer = dict(lw.mixer, **view(stacks[part], seen[part]))
        seen[part] += 1
        out.append(lw._replace(mixer=mixer, moe=dict(lw.moe, **view(stacks["moe"], p))))
    return out


def layer_groups(cfg: Config, layers, body, carry, parallelism=None):
    """`carry` after `body(carry, group, gi)` over the layer groups in order, `group` the group's `LayerWeights` in
    `layer_pattern` order: an unrolled loop over per-layer weights (gi an int), a scan over stacked ones (gi
    traced). `parallelism` given (the engine's step): the stacks its plan's kernels read in place stay whole, each
    layer handed `LayerOf` views of them (`model.moe.stacked_experts`, `stacked_dense`); else every layer's weights
    are the scan's slices (`forward`)."""
    if is_per_layer(layers):
        for gi, group in enumerate(layers):
            with jax.named_scope(f"layer_group_{gi}"):
                carry = body(carry, list(group), gi)
        return carry
    experts = dense_stacks = {}
    if parallelism is not None:
        layers, experts = stacked_experts(cfg, layers, parallelism.plan)
        layers, dense_stacks = stacked_dense(cfg, layers, parallelism.plan)

    def step(carry, xs):
        w, gi = xs
        group = with_dense(cfg, with_experts(group_layers(cfg, w), experts, gi), dense_stacks, gi, parallelism)
        return body(carry, group, gi), None

    with jax.named_scope("layer_group"):
        carry, _ = jax.lax.scan(step, carry, (layers, jnp.arange(cfg.num_groups)))
    return carry


@jax.tree_util.register_pytree_node_class
class LayerPools:
    """The cache's pools, layer j's part of each read and written the same way whatever its form (a pytree: it
    rides the scan's carry):
    - per-layer (a tuple of L buffers [R, ...], `per_layer_cache`): layer j gets its own buffer, and `put` replaces
      it (j an int: the unrolled loop);
    - stacked ([R, L, X, ...]): held merged as [R, L*X, ...] (a bitcast); every layer gets the whole pool and
      addresses its pages or slots as rows j*X + x (`rows`), so each update lands in place: no layer's pool is
      sliced out and written back (j may be traced: the scan).
    `cache()` gives the pools back in the cache's form."""

    def __init__(self, pools: dict, stacked: tuple = ()):
        self.pools = pools
        self.stacked = stacked  # ((name, its stacked shape [R, L, X, ...]), ...): the merged pools

    @classmethod
    def of(cls, cache: dict) -> LayerPools:
        merge = lambda a: a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])
        return cls({n: a if is_per_layer(a) else merge(a) for n, a in cache.items()},
                   tuple((n, a.shape) for n, a in cache.items() if not is_per_layer(a)))

    def cache(self) -> dict:
        shapes = dict(self.stacked)
        return {n: a.reshape(shapes[n]) if n in shapes else a for n, a in self.pools.items()}

    def get(self, j, names) -> dict:
        """Layer j's pools among `names` (those the cache holds): its own buffer, or the whole merged pool."""
        return {n: self.pools[n][j] if is_per_layer(self.pools[n]) else self.pools[n] for n in names
                if n in self.pools}

    def put(self, j, new: dict) -> LayerPools:
        """`new` {name: layer j's pool as `get` gave it, updated} written back."""
        pools = dict(self.pools)
        for n, a in new.items():
            pools[n] = pools[n][:j] + (a,) + pools[n][j + 1:] if is_per_layer(pools[n]) else a
        return LayerPools(pools, self.stacked)

    def rows(self, meta, field: str, name: str, j):
        """`meta` with its page table (field "page_table") or slots ("slot") moved to layer j's rows of pool
        `name`, merged (X rows a layer); as it is for a per-layer pool."""
        shapes = dict(self.stacked)
        if name not in shapes:
            return meta
        return meta._replace(**{field: getattr(meta, field) + j * shapes[name][2]})

    def tree_flatten(self):
        return (self.pools,), self.stacked

    @classmethod
    def tree_unflatten(cls, stacked, children):
        return cls(children[0], stacked)
