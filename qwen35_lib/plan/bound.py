"""A serving plan bound to a mesh and a model: the one record the engine, the ahead-of-time compiles and the cost
model read.

`ServingPlan.bind(mesh, config)` checks a plan (what is asked: a layout, routing, flags, a kernel family or "auto"
slots, cache dtypes) against the model on the mesh, once, and returns a `BoundPlan`: the mesh's sizes, the platform,
one implementation per kernel slot, the config as placed there and the cache dtypes. The plan itself is kept as
asked (`BoundPlan.plan`), and a bound plan reads as it for everything asked (`bound.layout`, `bound.routing`,
`bound.rules`, ...). Whether a plan is bound is its type; whether it is bound *here* is `BoundPlan.bound`, the one
test: an entry point binds once and hands the bound plan down, and every function below takes it as it is.

    run = get_stage("kernels").bind(make_mesh(), config)   # dp8_ep8 on 8 devices
    run.kernel("moe_matmul"), run.dp, run.config           # "pallas" (TPU) / "native" (CPU), 8, the placed config
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from qwen35_lib.config import Config
from qwen35_lib.plan.kernels import KERNEL_FIELDS, resolve
from qwen35_lib.plan.layouts import Axes
from qwen35_lib.plan.mesh import AXES, axis_size

ServingPlan = Any  # `plan.record.ServingPlan`, which imports this module (its `bind` is `bind` here)


@dataclasses.dataclass(frozen=True)
class BoundPlan:
    """A `ServingPlan` as it runs on one mesh, for one model: sizes, platform, kernels, placed config, cache dtypes.
    Frozen and hashable (a static argument of the jitted step). Everything asked reads through to `plan`."""

    plan: ServingPlan  # what was asked, as asked ("auto" slots kept)
    mesh_shape: tuple[tuple[str, int], ...] | None  # the mesh the sizes come from; None: one device, no mesh
    platform: str  # the platform the kernels run on ("cpu", "tpu", "gpu")
    impls: tuple[tuple[str, str], ...]  # (slot, implementation) of every slot of `plan.kernels.SLOTS`
    config: Config | None = None  # the config the program runs (`place`d once, at binding); None: no model bound
    model: Config | None = None  # the config as given to `bind` (the checkpoint's shapes)
    kv_dtype: str | None = None  # the paged KV cache's dtype; None: the model dtype
    gdn_state_dtype: str | None = None  # the recurrent GDN state's; None: the config's
    kv_whole: bool = False  # tp_kvrep's KV heads neither divide nor duplicate evenly here: whole on every device

    def __getattr__(self, name: str):  # what was asked: the plan's fields and placement (layout, routing, flags, ...)
        if name.startswith("__") or name == "plan":
            raise AttributeError(name)
        return getattr(self.plan, name)

    def bound(self, mesh, config: Config | None = None, platform: str | None = None,
              kv_dtype: str | None = None) -> BoundPlan:
        """Itself where it is bound to `mesh` already (the same sizes; None for a one-device plan), for `platform`
        (None: any) and, where `config` is given, to a model, as an entry point bound it and handed it down (with
        `kv_dtype` where its plan names none); else its plan bound there. The one "already bound?" test."""
        shape = None if mesh is None else _shape(mesh)
        platform = platform or (_platform(mesh) if _concrete(mesh) else None)
        if not (platform in (None, self.platform) and (config is None or self.config is not None)
                and (self.mesh_shape == shape or (self.layout == "single" and shape is None))):
            return bind(self.plan, mesh, config, platform, kv_dtype)
        if kv_dtype is None or self.plan.kv_dtype is not None or kv_dtype == self.kv_dtype:
            return self
        return dataclasses.replace(self, kv_dtype=kv_dtype)  # the entry point's default: the plan names none

    def on_devices(self, devices: int) -> ServingPlan | BoundPlan:
        """Itself on the device count it is bound to, else its plan as it runs on `devices` (unbound)."""
        return self if self.ways(AXES) == devices else self.plan.on_devices(devices)

    # --- kernels ---
    def kernel(self, slot: str) -> str:
        """The implementation kernel `slot` (`plan.kernels.SLOTS`) runs, as bound."""
        return dict(self.impls)[slot]

    @property
    def kernel_names(self) -> dict[str, str]:
        """{ServingPlan field (`attention_kernel`, ...): implementation} of every slot, as bound."""
        return {f: self.kernel(slot) for slot, f in KERNEL_FIELDS.items()}

    # --- placement on this mesh ---
    @property
    def rules(self) -> tuple[tuple[str, Axes], ...]:
        rules = self.plan.rules
        return tuple(r for r in rules if r[0] != "kv_heads") if self.kv_whole else rules

    def axes(self, logical: str | None) -> Axes:
        return dict(self.rules).get(logical) if logical else None

    def ways(self, axes: Axes) -> int:
        """Devices along mesh `axes` (a name, a tuple of names, or None = 1) of the mesh it is bound to."""
        if axes is None or self.layout == "single":
            return 1
        if self.mesh_shape is None:
            raise ValueError(f"plan {self.name!r} is bound to no mesh: bind it to one (plan.bind(mesh, config))")
        shape = dict(self.mesh_shape)
        return math.prod(shape[a] for a in ((axes,) if isinstance(axes, str) else axes))

    @property
    def dp(self) -> int:  # data-parallel ranks (the engine's R axis)
        return self.ways(self.batch_axes)

    @property
    def tp(self) -> int:  # ways attention / GDN query heads are split
        return self.ways(self.axes("q_heads"))

    @property
    def ep(self) -> int:  # expert-parallel ways
        return 1 if self.moe != "ep" else self.ways(self.ep_axes)

    def kv_replication(self, config: Config) -> int:
        """Copies of each KV head in the weights: `kv_copies` under `tp_kvrep`, else 1."""
        if not self.kv_replicated:
            return 1
        return kv_copies(config, self.ways(self.axes("kv_heads")))

    def kv_heads_per_device(self, config: Config) -> int:
        """KV heads a device stores: Hkv / kv ways when they divide, max(1, Hkv/tp) under `tp_kvrep`, all of them
        when the layout does not split KV heads."""
        return kv_heads_per_device(config, self.ways(self.axes("kv_heads")), self.kv_replicated)

    def place(self, config: Config) -> Config:
        """`config` as the program runs it here: under `tp_kvrep`, Hkv duplicated heads x the replication factor
        (the weights `shard_weights` places carry them), so the cache and projections split evenly; the plan's GDN
        state dtype where it names one. Placing a placed config changes nothing."""
        if self.plan.gdn_state_dtype is not None and self.plan.gdn_state_dtype != config.gdn_state_dtype:
            config = config.replace(gdn_state_dtype=self.plan.gdn_state_dtype)
        r = self.kv_replication(config)
        return config if r == 1 else config.replace(num_kv_heads=config.num_kv_heads * r)

    def placed(self, config: Config | None = None) -> Config:
        """The config the program runs: the one placed when it was bound (computed once) where `config` is None,
        the model bound or that placed config (the same objects: `Config` equality ignores the name and EOS ids);
        else `config` placed here."""
        if config is None or config is self.model or config is self.config:
            if self.config is None:
                raise ValueError(f"plan {self.name!r} was bound without a model: bind it with one "
                                 "(plan.bind(mesh, config)) or pass the config")
            return self.config
        return self.place(config)


def bind(plan: ServingPlan, mesh, config: Config | None = None, platform: str | None = None,
         kv_dtype: str | None = None) -> BoundPlan:
    """`ServingPlan.bind`: `plan` bound to `mesh` (a Mesh or AbstractMesh; None: one device) and `platform`
    (default: the mesh's devices', else JAX's default backend). With `config`, the one check of the plan against
    the model there first (`_checked`: a ValueError naming the constraint it breaks and the fix), and the config
    placed. `kv_dtype`: the entry point's default KV cache dtype, where the plan names none (a plan's own wins)."""
    whole = _checked(plan, mesh, config) if config is not None else False
    platform = platform or _platform(mesh)
    run = BoundPlan(plan, None if mesh is None else _shape(mesh), platform,
                    tuple(resolve(plan, platform).items()), kv_dtype=plan.kv_dtype or kv_dtype, kv_whole=whole)
    if config is None:
        return dataclasses.replace(run, gdn_state_dtype=plan.gdn_state_dtype)
    placed = run.place(config)
    return dataclasses.replace(run, config=placed, model=config, gdn_state_dtype=placed.gdn_state_dtype)


def kv_copies(config: Config, ways: int) -> int:
    """Copies of each KV head `tp_kvrep` puts in the weights for KV heads split `ways` ways: r = ways / Hkv when
    that is a whole number > 1 (each device then keeps the one head its query heads read), else 1. r must divide
    the query heads per KV head (query head q reads copy q // (Hq / (Hkv r)), a copy of its head q // (Hq / Hkv));
    where it does not, r = 1 and KV heads that do not divide stay whole on every device."""
    h = config.num_kv_heads
    r = ways // h if ways > h and ways % h == 0 else 1
    return r if (config.num_q_heads // h) % r == 0 else 1


def kv_heads_per_device(config: Config, ways: int, replicated: bool) -> int:
    """KV heads one device stores when they are split `ways` ways (duplicated first if `replicated`): an even
    share, or all of them when they do not divide (kept whole)."""
    heads = config.num_kv_heads * (kv_copies(config, ways) if replicated else 1)
    return heads // ways if heads % ways == 0 else heads


def _shape(mesh) -> tuple[tuple[str, int], ...]:
    return tuple((a, int(n)) for a, n in dict(mesh.shape).items())


def _concrete(mesh) -> bool:
    """A Mesh of devices (not an AbstractMesh, not None): its devices' platform is known."""
    import jax

    return isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size > 0


def _platform(mesh) -> str:
    """The platform of `mesh`'s devices (a Mesh's; "cpu", "tpu", ...), else JAX's default backend (an
    AbstractMesh or no mesh)."""
    import jax

    return mesh.devices.flat[0].platform if _concrete(mesh) else jax.default_backend()


def _checked(plan: ServingPlan, mesh, config: Config) -> bool:
    """`bind`'s one check of `plan` against the model `config` on `mesh` (a ValueError naming the constraint and the
    fix); returns whether tp_kvrep's KV heads stay whole on every device there."""
    if plan.layout == "single":
        return False
    if mesh is None:
        raise ValueError(f"layout {plan.layout!r} needs a mesh: pass mesh=qwen35_lib.plan.make_mesh() (the devices "
                         "as ('chip', 'core')), or run it under `with jax.set_mesh(mesh):`")
    missing = set(AXES) - set(mesh.axis_names)
    if missing:
        raise ValueError(f"layout {plan.layout!r} needs mesh axes {AXES}; this mesh has {mesh.axis_names}: build it "
                         "with qwen35_lib.plan.make_mesh()")
    n = axis_size(mesh, AXES)
    if plan.devices is not None and n != plan.devices:
        raise ValueError(f"layout {plan.layout!r} is the {plan.devices}-device instance of {plan.general!r}; this "
                         f"mesh has {n} devices: use layout {plan.general!r} (its sizes come from the mesh)")
    kv = axis_size(mesh, plan.axes("kv_heads"))
    heads = config.num_kv_heads * (kv_copies(config, kv) if plan.kv_replicated else 1)
    if heads % kv and not plan.kv_replicated:  # tp_kvrep keeps what does not divide whole on every device
        dp_ep, kvrep = ("dp8_ep8", "tp8_kvrep") if n == 8 else ("dp_ep", "tp_kvrep")
        raise ValueError(
            f"{config.num_kv_heads} KV heads cannot be split over {kv} devices of axes {plan.axes('kv_heads')} "
            f"(layout {plan.layout!r}: {config.num_kv_heads}/{kv} heads per device); use layout {dp_ep!r} or "
            f"replicate KV heads with {kvrep!r} (each device then keeps the one its query heads read: "
            f"{kv // math.gcd(kv, config.num_kv_heads)}x the KV-cache memory of an even split)")
    ep = axis_size(mesh, plan.ep_axes) if plan.moe == "ep" else 1
    if plan.moe == "ep" and config.num_experts % ep:
        raise ValueError(f"{config.num_experts} experts cannot be split evenly over {ep} devices (expert "
                         f"parallelism over {plan.ep_axes}): use an expert count that is a multiple of {ep}, "
                         "or a tensor-parallel layout ('tp_kvrep')")
    tp = axis_size(mesh, plan.tp_axes)
    if plan.moe == "tp" and config.moe_ffn % tp:
        raise ValueError(f"expert FFN size {config.moe_ffn} cannot be split over {tp} devices (layout "
                         f"{plan.layout!r}); use an EP layout ('dp_ep')")
    if plan.moe == "tp" and config.expert_dtype and (config.moe_ffn // config.fp8_block_size) % tp:
        raise ValueError(f"FP8 expert scales ({config.moe_ffn // config.fp8_block_size} blocks of "
                         f"{config.fp8_block_size} along the FFN) cannot be split over {tp} devices: use "
                         "expert_dtype=None or an EP layout ('dp_ep')")
    problem = plan.collective_flags_problem()
    if problem:
        raise ValueError(problem)
    return bool(heads % kv)


__all__ = ["BoundPlan", "bind", "kv_copies", "kv_heads_per_device"]
