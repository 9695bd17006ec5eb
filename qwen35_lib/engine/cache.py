"""The serving caches: a paged KV cache for attention layers and per-sequence state slots for GDN layers.

Declared like the weights (`ArrayInfo` leaves with logical axes), with a leading data-parallel rank axis R (each
rank owns its own page and slot pools, so a data-parallel layout only shards what is already split), then the layers
of a kind, L (La attention layers, Lg GDN layers; layer j of a kind is group j // n, position j % n of that kind).

One pool per kind, updated in place: a step reads the pool of a kind as one array [R, L*X, ...] (its leading layer
and page/slot dims merged: a bitcast) and addresses layer j's page p as row j*X + p
(`model.layer_loop.LayerPools`), so no layer's pool is ever sliced out and written back (the engine's scan carries
whole pools; every write is a scatter or an aliased kernel output into them).

- `kv`    [R, La, P, ps, 2*Hkv*d]: P pages of ps tokens per rank and layer; in a page, token-major, then K and V of
  every KV head interleaved in one minor dim (index (2h + j)*d + i: j = 0 K, j = 1 V of head h, i < d); an FP8
  pool the XLA attention reads on a TPU holds them as uint32 words [..., 2*Hkv*d / 4] (`CacheShape.kv_words`). One page
  is one contiguous block: a ragged paged attention kernel reads it with one DMA. Heads and head_dim are merged
  so that a TPU kernel reads the pool in place (its tiles span the two minor dims: a reshape of them would copy
  the whole pool); a split over "kv_heads" still gives each device whole heads, K and V together. Page 0 of each
  layer is the null page that padding tokens write to; it is never handed to a sequence.
- `conv_q`, `conv_k` [R, Lg, NS, K-1, Hk, dk], `conv_v` [R, Lg, NS, K-1, Hv, dv]: the last K - 1 inputs of the
  causal conv; `state` [R, Lg, NS, Hv, dk, dv]: the recurrent state (Config.gdn_state_dtype).
  NS slots per rank and layer; slot 0 is the null slot.
- `kv_scale` [R, La, P, 2*Hkv, ps] float32, only for an FP8 (e4m3) KV cache: one scale per token and head,
  token-minor (index [page, 2h + j, offset], j as in `kv`): a page's scales of one head are one row, the keys'
  axis of a kernel's scores, and a pool with ps a multiple of 128 is lane-dense (no relayout for a TPU kernel).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from qwen35_lib.config import Config
from qwen35_lib.kernels import for_plan
from qwen35_lib.kernels.attention.xla import WORD
from qwen35_lib.parallel.shardings import shardings
from qwen35_lib.plan import BoundPlan, ServingPlan
from qwen35_lib.weights import ArrayInfo, is_info


@dataclasses.dataclass(frozen=True)
class CacheShape:
    ranks: int = 1  # data-parallel ranks, each with its own pools
    num_pages: int = 64  # per rank, including the null page 0
    page_size: int = 16
    num_slots: int = 9  # per rank, including the null slot 0: at most num_slots - 1 running sequences
    kv_dtype: str | None = None  # None: the model dtype; "float8_e4m3fn": FP8 with per-token scales
    kv_words: bool = False  # the FP8 pool as uint32 words, 4 values a word (`kv_words_for`)
    # V = 1 + speculative tokens: with V > 1 each GDN slot also keeps V state checkpoints and a conv window of
    # K - 1 + V inputs (the `*_ckpt` pools), from which a verification keeps the accepted position's
    verify: int = 1

    def __post_init__(self):
        if self.num_pages < 2 or self.num_slots < 2 or self.page_size < 1 or self.ranks < 1:
            raise ValueError(f"cache needs >= 2 pages and >= 2 slots per rank (0 is the null one): {self}")
        if self.kv_words and self.kv_dtype != "float8_e4m3fn":
            raise ValueError(f"kv_words stores an FP8 KV cache (kv_dtype='float8_e4m3fn'), not {self.kv_dtype}")

    @classmethod
    def for_requests(cls, requests: int, context_len: int, *, ranks: int = 1, page_size: int = 16,
                     kv_dtype: str | None = None, kv_words: bool = False) -> CacheShape:
        """The pools for `requests` concurrent sequences of up to `context_len` tokens spread over `ranks`
        data-parallel ranks (the one home of this formula: the AOT compiles, the sweep, the cost model and
        `placement` all read it).

        1. sequences per rank S = ceil(requests / ranks);
        2. pages per rank: S whole contexts, ceil(context_len / page_size) pages each, plus the null page;
        3. GDN slots per rank: one a sequence plus the null slot.
        `kv_words`: the FP8 pool as uint32 words, where a bound plan says so (`kv_words_for(plan)`)."""
        per_rank = -(-requests // ranks)
        return cls(ranks=ranks, num_pages=per_rank * -(-context_len // page_size) + 1, page_size=page_size,
                   num_slots=per_rank + 1, kv_dtype=kv_dtype, kv_words=kv_words)

    @property
    def seqs_per_rank(self) -> int:
        """Running sequences a rank's slots hold (the null slot aside)."""
        return self.num_slots - 1


def kv_words_for(plan: BoundPlan) -> bool:
    """Whether the bound `plan` keeps its FP8 KV pool (`BoundPlan.kv_dtype`) as uint32 words, as its attention asks
    (`AttentionKernels.kv_words`: the XLA attention on a TPU, `kernels.attention.xla.kv_words`)."""
    return plan.kv_dtype == "float8_e4m3fn" and for_plan("attention", plan).kv_words


def declare_cache(config: Config, shape: CacheShape) -> dict:
    c, s = config, shape
    Lg, La, R, K = c.num_groups * c.gdn_per_group, c.num_groups * c.attn_per_group, s.ranks, c.gdn_conv_kernel
    dt = jnp.dtype(c.dtype)
    lead = ("batch", None)
    out = {}
    if La:
        pages = (R, La, s.num_pages)
        kv_dtype, width = jnp.dtype(s.kv_dtype or c.dtype), 2 * c.num_kv_heads * c.head_dim
        out["kv"] = ArrayInfo((*pages, s.page_size, width // WORD if s.kv_words else width),
                              jnp.dtype(jnp.uint32) if s.kv_words else kv_dtype, (*lead, None, None, "kv_heads"),
                              "zeros")
        if kv_dtype.itemsize == 1:
            out["kv_scale"] = ArrayInfo((*pages, 2 * c.num_kv_heads, s.page_size), jnp.float32,
                                        (*lead, None, "kv_heads", None), "ones")
    if Lg:
        slots = (R, Lg, s.num_slots)
        for name, heads, hd, axis in (("conv_q", c.gdn_num_k_heads, c.gdn_k_head_dim, "gdn_k_heads"),
                                      ("conv_k", c.gdn_num_k_heads, c.gdn_k_head_dim, "gdn_k_heads"),
                                      ("conv_v", c.gdn_num_v_heads, c.gdn_v_head_dim, "gdn_v_heads")):
            out[name] = ArrayInfo((*slots, K - 1, heads, hd), dt, (*lead, None, None, axis, None), "zeros")
        out["state"] = ArrayInfo((*slots, c.gdn_num_v_heads, c.gdn_k_head_dim, c.gdn_v_head_dim),
                                 jnp.dtype(c.gdn_state_dtype), (*lead, None, "gdn_v_heads", None, None), "zeros")
        if s.verify > 1:  # speculative verification's checkpoints: one more axis after the slot
            for name in ("conv_q", "conv_k", "conv_v", "state"):
                i, conv = out[name], name != "state"
                rest = 4 if conv else 3  # a conv window replaces the K - 1 history rows; the state gains an axis
                out[f"{name}_ckpt"] = ArrayInfo((*slots, s.verify + (K - 1 if conv else 0), *i.shape[rest:]), i.dtype,
                                                (*i.logical_axes[:3], None, *i.logical_axes[rest:]), "zeros")
    return out


def init_cache(config: Config, shape: CacheShape) -> dict:
    """Zeroed caches (unit scales)."""
    return jax.tree.map(lambda i: jnp.full(i.shape, 1 if i.init == "ones" else 0, i.dtype),
                        declare_cache(config, shape), is_leaf=is_info)


PAGED = ("kv", "kv_scale")  # the pools addressed by page; the others by GDN slot


def copy_rows(cache: dict, pages, slots) -> dict:
    """`cache` with page rows and slot rows copied in every layer: `pages`, `slots` [R, K, 2] int32 (source,
    destination) per rank, (0, 0) for padding (the null row onto itself). Each pool either [R, L, X, ...] or a tuple
    of L per-layer arrays [R, X, ...] (`model.layer_loop.per_layer_cache`)."""
    def copy(a, rows):
        r, src, dst = jnp.arange(rows.shape[0])[:, None], rows[..., 0], rows[..., 1]  # [R, 1], [R, K], [R, K]
        if isinstance(a, (tuple, list)):
            return type(a)(x.at[r, dst].set(x[r, src]) for x in a)
        return a.at[r, :, dst].set(a[r, :, src])
    return {name: copy(pool, pages if name in PAGED else slots) for name, pool in cache.items()}


def abstract_cache(config: Config, shape: CacheShape, plan: ServingPlan | None = None, mesh=None) -> dict:
    """`jax.ShapeDtypeStruct` leaves of `declare_cache(config, shape)`, with the bound `plan`'s shardings on `mesh`
    where one is given (`cache_shardings`): caches for a compile, nothing allocated (`weights.abstract_weights`'
    twin)."""
    decl = declare_cache(config, shape)
    if mesh is None:
        return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), decl, is_leaf=is_info)
    return jax.tree.map(lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s), decl,
                        cache_shardings(config, plan, shape, mesh), is_leaf=is_info)


def cache_bytes(config: Config, shape: CacheShape) -> int:
    return sum(i.nbytes for i in jax.tree.leaves(declare_cache(config, shape), is_leaf=is_info))


def cache_shardings(config: Config, plan: ServingPlan, shape: CacheShape, mesh) -> dict:
    """NamedShardings for every cache array of `config` at `shape` under the bound `plan` on `mesh` (a tree like
    the caches)."""
    return shardings(declare_cache(config, shape), plan, mesh)


def device_cache_bytes(config: Config, shape: CacheShape, mesh=None, plan: ServingPlan | None = None) -> dict:
    """{device: bytes of the caches it holds}: one default device without a mesh, else each device of the mesh
    its shards (replicated leaves in full), from the bound `plan`'s shardings; nothing is allocated."""
    decl = declare_cache(config, shape)
    infos = jax.tree.leaves(decl, is_leaf=is_info)
    if mesh is None:
        return {jax.devices()[0]: sum(i.nbytes for i in infos)}
    out: dict = {}
    for info, sharding in zip(infos, jax.tree.leaves(cache_shardings(config, plan, shape, mesh))):
        n = math.prod(sharding.shard_shape(info.shape)) * jnp.dtype(info.dtype).itemsize
        for d in sharding.device_set:
            out[d] = out.get(d, 0) + n
    return out


def available_bytes(device) -> tuple[int, str] | None:
    """(bytes `device` can still allocate, where the figure comes from), or None where it cannot be known.
    CPU: the host's MemAvailable (/proc/meminfo), shared by every CPU device of the process; an accelerator:
    `memory_stats()` bytes_limit - bytes_in_use."""
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return None
        return kib * 1024, "host RAM, MemAvailable"
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory statistics
        return None
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.platform} memory of {device}"


def memory_shortfall(config: Config, shape: CacheShape, mesh=None, plan: ServingPlan | None = None) -> str | None:
    """None when the caches fit the memory of the devices (and host) that would hold them (on `mesh` under the
    bound `plan`, else one device), else what is short: CPU devices of this process share host RAM and are checked
    together, each accelerator on its own."""
    per_device = device_cache_bytes(config, shape, mesh) if mesh is None else \
        device_cache_bytes(config, shape, mesh, plan)
    pools: dict = {}  # (pool key) -> [bytes needed, a device of it]
    for d, n in per_device.items():
        if d.process_index != jax.process_index():
            continue  # another process checks its own devices
        key = "host" if d.platform == "cpu" else d
        pools.setdefault(key, [0, d])[0] += n
    for need, d in pools.values():
        avail = available_bytes(d)
        if avail is not None and need > avail[0]:
            return f"the caches need {need / 2**30:.2f} GiB but {avail[0] / 2**30:.2f} GiB is free ({avail[1]})"
    return None


def step_working_bytes(compiled) -> int | None:
    """One device's working memory of a compiled step: temporaries, and outputs not aliased to a donated input
    (`memory_analysis()` reports one device's share of an SPMD program); None where the backend does not say."""
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    return ma.temp_size_in_bytes + max(ma.output_size_in_bytes - ma.alias_size_in_bytes, 0)


def step_memory_shortfall(per_device: int | None, devices) -> str | None:
    """None when a step's working memory (`step_working_bytes`, per device) fits what `devices` can still
    allocate, else what is short. CPU devices of this process share host RAM and are charged together."""
    if per_device is None:
        return None
    pools: dict = {}  # (pool key) -> [bytes needed, a device of it]
    for d in devices:
        if d.process_index == jax.process_index():
            pools.setdefault("host" if d.platform == "cpu" else d, [0, d])[0] += per_device
    for need, d in pools.values():
        avail = available_bytes(d)
        if avail is not None and need > avail[0]:
            return (f"the step needs {_size(need)} of working memory beyond the caches but {_size(avail[0])} is "
                    f"free ({avail[1]})")
    return None


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
