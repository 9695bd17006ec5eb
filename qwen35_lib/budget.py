"""The memory budget of serving a model on a system: weights first, then what is left for the caches.

`hbm_budget(config, hardware, concurrency, context_len)`:
1. weight bytes per device, from the weight declarations (`qwen35_lib.stats`), for a weight spread:
   `even` spreads every weight over all devices (the floor any layout can reach); `experts_sharded` splits the
   routed experts over the devices and replicates everything else: the weights of the `dp_ep` layout plan
   (data-parallel attention + expert parallelism; `dp8_ep8` on 8 devices), `SPREAD_PLANS["experts_sharded"]` (the
   resident-bytes reference's bytes, `costmodel.traffic.weight_bytes`: tests/test_budget.py);
2. free bytes = devices x (HBM per device - weights per device - reserve per device);
3. caches of `concurrency` requests holding `context_len` tokens each: KV bytes per token x tokens, plus one
   GDN state (recurrent + conv) per request, which does not grow with the context;
4. the caches fit when they are at most the free bytes (requests spread evenly over the devices, as
   data-parallel attention does).
Activations and compiler workspace are not modelled; pass `reserve_bytes_per_device` to hold some back.

`compiled_weight_bytes` checks step 1 against XLA: it compiles a program taking the weights (abstract, nothing
allocated) placed as `spread` says on a TPU topology (`tpu7x:2x2x1` by default, needs libtpu) and reads the
per-device argument bytes, or the compiler's refusal when they do not fit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qwen35_lib import hardware as hw
from qwen35_lib.config import Config
from qwen35_lib.plan import get_layout
from qwen35_lib.stats import model_stats
from qwen35_lib.weights import abstract_weights, declare, is_info

WEIGHT_SPREADS = ("even", "experts_sharded")  # how the weights are spread over the devices (module docstring)
SPREAD_PLANS = {"experts_sharded": get_layout("dp_ep")}  # the plan a spread is; `even` is a floor, not a layout


@dataclasses.dataclass(frozen=True)
class HbmBudget:
    """Weights vs caches on one system. Byte counts are for the whole system unless named `_per_device`."""

    model: str
    hardware: str
    spread: str
    devices: int
    hbm_bytes_per_device: int
    usable_hbm_bytes_per_device: int  # what a program may use: where fits are judged
    reserve_bytes_per_device: int
    weight_bytes: int  # the model once
    weight_bytes_per_device: int  # under `spread`
    weight_dtypes: str  # e.g. "bfloat16 + float8_e4m3fn experts"
    kv_dtype: str
    gdn_state_dtype: str
    kv_bytes_per_token: int
    gdn_state_bytes_per_seq: int
    concurrency: int
    context_len: int

    @property
    def hbm_bytes(self) -> int:
        return self.devices * self.hbm_bytes_per_device

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes_per_device + self.reserve_bytes_per_device <= self.usable_hbm_bytes_per_device

    @property
    def weight_bytes_on_devices(self) -> int:
        """Weights summed over the devices (more than `weight_bytes` when some are replicated)."""
        return self.devices * self.weight_bytes_per_device

    @property
    def free_bytes(self) -> int:
        """Bytes left for caches on the whole system (negative when the weights do not fit)."""
        return self.devices * (self.usable_hbm_bytes_per_device - self.weight_bytes_per_device -
                                self.reserve_bytes_per_device)

    @property
    def kv_cache_bytes(self) -> int:
        return self.concurrency * self.context_len * self.kv_bytes_per_token

    @property
    def gdn_state_bytes(self) -> int:
        return self.concurrency * self.gdn_state_bytes_per_seq

    @property
    def cache_bytes(self) -> int:
        return self.kv_cache_bytes + self.gdn_state_bytes

    @property
    def left_bytes(self) -> int:
        """Free bytes after the caches of `concurrency` requests (negative: they do not fit)."""
        return self.free_bytes - self.cache_bytes

    @property
    def fits(self) -> bool:
        return self.weights_fit and self.left_bytes >= 0

    @property
    def max_kv_tokens(self) -> int:
        """Tokens of KV cache the free bytes hold if they held nothing else."""
        return hw.capacity(self.free_bytes, self.kv_bytes_per_token)

    @property
    def max_gdn_seqs(self) -> int:
        """GDN states (one per request) the free bytes hold if they held nothing else."""
        return hw.capacity(self.free_bytes, self.gdn_state_bytes_per_seq)

    @property
    def max_concurrency(self) -> int:
        """Requests of `context_len` tokens whose KV cache and GDN state fit together."""
        return hw.capacity(self.free_bytes, self.context_len * self.kv_bytes_per_token + self.gdn_state_bytes_per_seq)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in ("hbm_bytes", "weights_fit", "weight_bytes_on_devices", "free_bytes", "kv_cache_bytes",
                     "gdn_state_bytes", "cache_bytes", "left_bytes", "fits", "max_kv_tokens", "max_gdn_seqs",
                     "max_concurrency"):
            d[name] = getattr(self, name)
        return d


def routed_expert_bytes(config: Config) -> int:
    """Bytes of the routed experts (FP8 scales included): the part expert parallelism splits."""
    moe = declare(config)["layers"]["moe"]
    return sum(i.nbytes for i in jax.tree.leaves((moe["w_gate_up"], moe["w_down"]), is_leaf=is_info))


def weight_bytes_per_device(config: Config, devices: int, spread: str = "even") -> int:
    """Weight bytes on each of `devices` devices under `spread` (see the module docstring)."""
    if spread not in WEIGHT_SPREADS:
        raise ValueError(f"unknown weight spread {spread!r}; use one of {WEIGHT_SPREADS}")
    total = model_stats(config).weight_bytes
    if spread == "even":
        return -(-total // devices)
    experts = routed_expert_bytes(config)
    return total - experts + -(-experts // devices)


def hbm_budget(config: Config, hardware: hw.Hardware | str, concurrency: int = 0, context_len: int = 0, *,
               kv_dtype: str | None = None, spread: str = "even", reserve_bytes_per_device: int = 0) -> HbmBudget:
    """Weights of `config` on `hardware` and the caches of `concurrency` requests of `context_len` tokens.

    Dtypes come from the config (`dtype`, `expert_dtype`, `gdn_state_dtype`); `kv_dtype` defaults to `dtype`.
    """
    if concurrency < 0 or context_len < 0:
        raise ValueError(f"concurrency={concurrency} and context_len={context_len} must be >= 0")
    hardware = hw.get(hardware) if isinstance(hardware, str) else hardware
    stats = model_stats(config, kv_dtype=kv_dtype)
    experts = f" + {config.expert_dtype} experts" if config.expert_dtype else ""
    return HbmBudget(
        model=config.name, hardware=hardware.name, spread=spread, devices=hardware.devices,
        hbm_bytes_per_device=hardware.hbm_bytes_per_device,
        usable_hbm_bytes_per_device=hardware.usable_hbm_bytes_per_device,
        reserve_bytes_per_device=reserve_bytes_per_device,
        weight_bytes=stats.weight_bytes,
        weight_bytes_per_device=weight_bytes_per_device(config, hardware.devices, spread),
        weight_dtypes=config.dtype + experts, kv_dtype=kv_dtype or config.dtype,
        gdn_state_dtype=config.gdn_state_dtype, kv_bytes_per_token=stats.kv_bytes_per_token,
        gdn_state_bytes_per_seq=stats.gdn_state_bytes_per_seq, concurrency=concurrency, context_len=context_len)


# ---------------------------------------------------------------------------------------------------------------
# The same spread, compiled ahead of time for a TPU topology.


@dataclasses.dataclass(frozen=True)
class CompiledWeights:
    """What XLA made of the weights under a spread: per-device bytes, or why it refused."""

    spread: str
    topology: str
    argument_bytes_per_device: int | None  # None when the compile failed
    error: str | None  # the compiler's message (e.g. RESOURCE_EXHAUSTED: Ran out of memory on HBM ...)


def weight_shardings(config: Config, mesh: Mesh, spread: str = "even") -> Any:
    """`NamedSharding`s over all axes of `mesh` for every weight, as `spread` says.

    `experts_sharded`: the `dp_ep` layout's own shardings (`parallel.shardings.weight_shardings`: the `experts`
    logical axis over the whole mesh, the rest replicated). `even`: each weight split on its first dim the mesh
    size divides (replicated when none does: a few norm-sized arrays at most).
    """
    if spread not in WEIGHT_SPREADS:
        raise ValueError(f"unknown weight spread {spread!r}; use one of {WEIGHT_SPREADS}")
    if spread in SPREAD_PLANS:
        from qwen35_lib.parallel.shardings import weight_shardings as layout_shardings

        return layout_shardings(config, SPREAD_PLANS[spread].bind(mesh, config), mesh)
    axes, size = tuple(mesh.axis_names), mesh.devices.size

    def spec(info) -> PartitionSpec:
        dims = [d for d, n in enumerate(info.shape) if n % size == 0][:1]
        return PartitionSpec(*[axes if d in dims else None for d in range(len(info.shape))])

    return jax.tree.map(lambda i: NamedSharding(mesh, spec(i)), declare(config), is_leaf=is_info)


def compiled_weight_bytes(config: Config, spread: str = "even", topology: str | None = None) -> CompiledWeights:
    """Per-device weight bytes as XLA compiles them for `topology` (default TPU7x-8), nothing allocated."""
    from qwen35_lib import aot

    topology = topology or aot.TPU7X_8
    mesh = aot.chip_core_mesh(aot.topology_devices(topology))
    weights = abstract_weights(config, weight_shardings(config, mesh, spread))
    return CompiledWeights(spread, topology, *aot.argument_bytes(weights))
