"""The serving plan: one frozen, hashable record of how a model is served on a mesh.

A `ServingPlan` names a layout (how attention, GDN and the MoE are placed: the logical-axis rules of
`plan.layouts.PLACEMENTS`), the MoE routing of an EP layout, the collective options, the kernel family (resolved
per backend by `plan.kernels.family_kernels`) and the cache dtypes. Sizes are never written in a plan: they come
from the mesh it is bound to (`plan.bind(mesh)`), so the general layouts run on any `('chip', 'core')` mesh whose
sizes divide (1, 2, 4, 8, 16 devices). A plan's name is its layout's for a layout plan (`get_layout`), or a
stage's (`plan.stages`). `plan.bind(mesh, config)` checks a plan against a model on a mesh, once, resolves each
kernel slot for the mesh's platform and returns the bound plan, or refuses it naming the constraint and the fix;
every entry point (the engine, the ahead-of-time compiles, the cost model) binds once and hands the bound plan down.
"""

from __future__ import annotations

import dataclasses
import math

from qwen35_lib.config import Config
from qwen35_lib.plan.kernels import BACKEND_DEFAULTS, FAMILIES, KERNEL_FIELDS, family_kernels
from qwen35_lib.plan.layouts import GENERAL, INSTANCES, LAYOUTS, PLACEMENTS, ROUTINGS, Axes
from qwen35_lib.plan.mesh import ALL, AXES, axis_size


@dataclasses.dataclass(frozen=True)
class ServingPlan:
    """How a model is served: placement (by layout), routing, collectives, kernels, cache dtypes; bound to a
    mesh (`bind`), its sizes. Field order keeps `ServingPlan("baseline", "tp8_kvrep")` a complete stage."""

    name: str
    layout: str  # one of plan.layouts.LAYOUTS
    routing: str | None = None  # EP layouts: "replicate" | "all_to_all"; None: the TP / local MoE
    fuse_allgather: bool = False  # replicate: top-k ids and weights in one all-gather (3 -> 2)
    hierarchical_rs: bool = False  # replicate: reduce-scatter over core, then chip
    kernels: str | None = "xla"  # kernel family (`plan.kernels.FAMILIES`); None: each slot the platform's default
    kv_dtype: str | None = None  # paged KV cache, read by the cost model (an Engine takes EngineConfig.kv_dtype)
    gdn_state_dtype: str | None = None  # recurrent GDN state (`placed_config` sets it); None: the config's
    mesh_shape: tuple[tuple[str, int], ...] | None = None  # set by `bind`: the mesh the sizes come from
    kv_whole: bool = False  # set by `bind` with a config: tp_kvrep's KV heads neither divide nor duplicate evenly here,
    #                         so they stay whole on every device (the cache's flat [.., 2·Hkv·d] is never cut)
    rs_micro_batches: int | None = None  # hierarchical_rs: micro-batches; None: tpu-inference's rule by tokens
    capacity_factor: float | None = None  # all_to_all: None = dropless; else slots per device = f * mean (drops)
    # each kernel slot's implementation (`qwen35_lib.kernels`); None or "auto": the family's (`kernels`), else the
    # platform's default (`plan.kernels.BACKEND_DEFAULTS`). `bind` resolves them for the mesh's platform.
    attention_kernel: str | None = None
    gdn_kernel: str | None = None
    moe_kernel: str | None = None
    permute_kernel: str | None = None
    dense_kernel: str | None = None  # the dense projections; "pallas" reads each layer's weights in place
    platform: str | None = None  # set by `bind`: the platform the kernels run on ("cpu", "tpu", "gpu")

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; layouts: {', '.join(LAYOUTS)}")
        if self.routing is not None and self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; use one of {ROUTINGS}")
        if self.rs_micro_batches is not None and self.rs_micro_batches < 1:
            raise ValueError(f"rs_micro_batches must be None (tpu-inference's rule) or >= 1; got "
                             f"{self.rs_micro_batches}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be None (dropless) or > 0; got {self.capacity_factor}")
        if self.kernels is not None and self.kernels not in FAMILIES:
            raise ValueError(f"unknown kernel family {self.kernels!r}; use one of {FAMILIES}")

    def replace(self, **changes) -> ServingPlan:
        return dataclasses.replace(self, **changes)

    # --- placement (from the layout) ---
    @property
    def general(self) -> str:
        """The layout's general form (`tp8_kvrep` -> `tp_kvrep`)."""
        return GENERAL[self.layout]

    @property
    def rules(self) -> tuple[tuple[str, Axes], ...]:
        rules = PLACEMENTS[self.general][0]
        return tuple(r for r in rules if r[0] != "kv_heads") if self.kv_whole else rules

    @property
    def moe(self) -> str:  # "local" | "tp" (expert FFN split, all-reduce) | "ep" (experts split, routed)
        return PLACEMENTS[self.general][1]

    @property
    def kv_replicated(self) -> bool:
        return PLACEMENTS[self.general][2]

    @property
    def summary(self) -> str:
        return PLACEMENTS[self.general][3]

    @property
    def devices(self) -> int | None:
        """Devices of a named instance (8 for `dp8_ep8`, 1 for `single`); None: any mesh."""
        return 8 if self.layout in INSTANCES else 1 if self.layout == "single" else None

    def axes(self, logical: str | None) -> Axes:
        return dict(self.rules).get(logical) if logical else None

    @property
    def batch_axes(self) -> Axes:  # data-parallel ranks (the engine's R axis)
        return self.axes("batch")

    @property
    def ep_axes(self) -> Axes:
        return self.axes("experts")

    @property
    def tp_axes(self) -> Axes:  # the axes the expert FFN is split over under "tp"
        return self.axes("moe_ffn")

    # --- the collective flags (the one home of their rule) ---
    @property
    def collective_flags_apply(self) -> bool:
        """Whether `fuse_allgather` and `hierarchical_rs` mean anything under this plan: a data-parallel EP layout
        with routing 'replicate' (token replication's all-gathers and the reduce-scatter back to the token shards).
        `bind`, `custom_stage`, the plan flags and the cost model's candidates all read this rule."""
        return self.moe == "ep" and self.batch_axes is not None and self.routing == "replicate"

    def collective_flags_problem(self) -> str | None:
        """None when the collective flags are off or apply here (`collective_flags_apply`), else why they cannot."""
        if not (self.fuse_allgather or self.hierarchical_rs) or self.collective_flags_apply:
            return None
        if self.layout == "single":
            return ("fuse_allgather and hierarchical_rs apply to EP layouts (dp4_tp2_ep8, dp8_ep8) with routing "
                    "'replicate'; layout 'single' has no collectives")
        if self.moe != "ep":
            return (f"fuse_allgather and hierarchical_rs apply to EP layouts with routing='replicate'; layout "
                    f"{self.layout!r} is not one")
        if self.routing != "replicate":
            return f"fuse_allgather and hierarchical_rs apply to routing='replicate' only; got routing={self.routing!r}"
        return (f"fuse_allgather and hierarchical_rs apply to data-parallel EP layouts ('dp_ep', 'dp_tp2_ep'); layout "
                f"{self.layout!r} has every token on every device: no all-gather and no reduce-scatter to fuse or "
                "split (its MoE ends in one all-reduce)")

    # --- sizes (from a mesh) ---
    def bind(self, mesh, config: Config | None = None, platform: str | None = None) -> ServingPlan:
        """This plan with the sizes of `mesh` (a Mesh or AbstractMesh; None: one device) and the kernel of every
        slot resolved for `platform` (default: the platform of the mesh's devices, else JAX's default backend).
        With `config`, the one check of the plan against a model on a mesh first (`_checked`: a ValueError naming
        the constraint it breaks and the fix), and the plan as that model runs there (`kv_whole` where tp_kvrep's
        KV heads neither divide nor duplicate). Every entry point (the engine, the ahead-of-time compiles, the cost
        model) binds once and hands the bound plan down."""
        plan = self if config is None else _checked(self, mesh, config)
        if mesh is not None and plan.mesh_shape is None:
            plan = dataclasses.replace(plan, mesh_shape=tuple((a, int(n)) for a, n in dict(mesh.shape).items()))
        return plan.resolve_kernels(platform or _platform(mesh))

    def bound(self, mesh, config: Config | None = None, platform: str | None = None) -> ServingPlan:
        """This plan bound to `mesh`: itself when it is bound there already (an entry point bound it and handed it
        down: nothing is derived twice), else `bind(mesh, config, platform)`."""
        shape = None if mesh is None else tuple((a, int(n)) for a, n in dict(mesh.shape).items())
        platform = platform or (_platform(mesh) if _concrete(mesh) else None)  # a mesh of other devices: rebound
        if (self.platform is not None and platform in (None, self.platform)
                and (self.mesh_shape == shape or (self.layout == "single" and shape is None))):
            return self
        return self.bind(mesh, config, platform)

    def resolve_kernels(self, platform: str) -> ServingPlan:
        """This plan with every kernel slot named for `platform` ("auto" -> the family's, else the platform's
        default implementation)."""
        family = family_kernels(self.kernels, platform) if self.kernels is not None else {}
        default = dict(BACKEND_DEFAULTS.get(platform, BACKEND_DEFAULTS["cpu"]))
        if self.layout != "single" and self.batch_axes != ALL:  # weights split by heads: XLA partitions the dots
            family, default = {**family, "dense_kernel": "xla"}, {**default, "dense": "xla"}
        return dataclasses.replace(self, platform=platform, **{
            f: getattr(self, f) if getattr(self, f) not in (None, "auto") else family.get(f, default[slot])
            for slot, f in KERNEL_FIELDS.items()})

    def kernel(self, slot: str) -> str:
        """The implementation name of kernel `slot` (`plan.kernels.SLOTS`) this plan runs: as bound, or, unbound,
        resolved for JAX's default backend."""
        plan = self if self.platform is not None else self.resolve_kernels(_platform(None))
        return getattr(plan, KERNEL_FIELDS[slot])

    @property
    def kernel_names(self) -> dict[str, str]:
        """{Config-style field (`attention_kernel`, ...): implementation} of every slot, as `kernel` resolves it."""
        return {f: self.kernel(slot) for slot, f in KERNEL_FIELDS.items()}

    def on_devices(self, devices: int) -> ServingPlan:
        """This plan as it runs on `devices` devices (still unbound): one device is `single`, whatever the plan
        says; an 8-device instance runs as its general form on another count (`dp8_ep8` on 4 devices is `dp_ep`:
        DP4 x EP4)."""
        if devices == 1:
            return dataclasses.replace(self, layout="single", routing=None, fuse_allgather=False,
                                       hierarchical_rs=False)
        if devices % 2:
            raise ValueError(f"{devices} devices do not form whole chips of 2 TensorCores; use an even device count")
        if self.devices is not None and self.devices != devices:
            return dataclasses.replace(self, layout=self.general)
        return self

    def _size(self, axes: Axes, mesh=None) -> int:
        if mesh is None:
            if self.mesh_shape is None:
                return 1 if axes is None or self.layout == "single" else _unbound(self)
            return math.prod(dict(self.mesh_shape)[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        return axis_size(mesh, axes)

    def dp_size(self, mesh=None) -> int:
        """Data-parallel ranks on `mesh` (default: the bound mesh)."""
        return 1 if self.layout == "single" else self._size(self.batch_axes, mesh)

    @property
    def dp(self) -> int:
        return self.dp_size()

    @property
    def tp(self) -> int:  # ways attention / GDN query heads are split
        return 1 if self.layout == "single" else self._size(self.axes("q_heads"))

    @property
    def ep(self) -> int:  # expert-parallel ways
        return 1 if self.moe != "ep" else self._size(self.ep_axes)

    def kv_replication(self, config: Config, mesh=None) -> int:
        """Copies of each KV head in the weights: `kv_copies` under `tp_kvrep`, else 1."""
        if not self.kv_replicated or self.layout == "single":
            return 1
        return kv_copies(config, self._size(self.axes("kv_heads"), mesh))

    def kv_heads_per_device(self, config: Config, mesh=None) -> int:
        """KV heads a device stores: Hkv / kv ways when they divide, max(1, Hkv/tp) under `tp_kvrep`, all of them
        when the layout does not split KV heads."""
        kv = 1 if self.layout == "single" else self._size(self.axes("kv_heads"), mesh)
        return kv_heads_per_device(config, kv, self.kv_replicated)

    def placed_config(self, config: Config, mesh=None) -> Config:
        """The config the program runs: under `tp_kvrep`, Hkv duplicated heads x the replication factor (the
        weights `shard_weights` places carry them), so the cache and projections split evenly; the plan's GDN
        state dtype where it names one."""
        if self.gdn_state_dtype is not None and self.gdn_state_dtype != config.gdn_state_dtype:
            config = config.replace(gdn_state_dtype=self.gdn_state_dtype)
        r = self.kv_replication(config, mesh)
        return config if r == 1 else config.replace(num_kv_heads=config.num_kv_heads * r)

    def rs_slices(self, tokens: int, devices: int) -> int:
        """Micro-batches the hierarchical reduce-scatter of a step of `tokens` tokens over `devices` devices runs
        (the code and the cost model both read this): `rs_micro_batches`, or tpu-inference's rule by `tokens`
        when None; 1 when the tokens each device keeps (tokens / devices) do not split into that many."""
        m = self.rs_micro_batches or micro_batches(tokens)
        return m if (tokens // devices) % m == 0 else 1


def micro_batches(tokens: int) -> int:
    """tpu-inference's hierarchical reduce-scatter micro-batch count: 1/2/4/8 for T < 256 / >= 256 / >= 2048 /
    >= 4096 tokens in the step (vllm-project/tpu-inference's `hierarchical_reduce_scatter_local`)."""
    return 8 if tokens >= 4096 else 4 if tokens >= 2048 else 2 if tokens >= 256 else 1


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


def _concrete(mesh) -> bool:
    """A Mesh of devices (not an AbstractMesh, not None): its devices' platform is known."""
    import jax

    return isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size > 0


def _platform(mesh) -> str:
    """The platform of `mesh`'s devices (a Mesh's; "cpu", "tpu", ...), else JAX's default backend (an
    AbstractMesh or no mesh)."""
    import jax

    if _concrete(mesh):
        return mesh.devices.flat[0].platform

    return jax.default_backend()


def _unbound(plan: ServingPlan) -> int:
    raise ValueError(f"plan {plan.name!r} has no mesh: bind it first (plan.bind(mesh)) or pass mesh=")


LAYOUT_PLANS: dict[str, ServingPlan] = {name: ServingPlan(name, name, kernels=None) for name in LAYOUTS}
SINGLE = LAYOUT_PLANS["single"]  # one device, each kernel slot the platform's default


def get_layout(name: str) -> ServingPlan:
    """The layout plan `name` (any of config.LAYOUTS: an 8-device instance or a general form)."""
    if name not in LAYOUT_PLANS:
        raise ValueError(f"unknown layout {name!r}; use one of {LAYOUTS}")
    return LAYOUT_PLANS[name]


def _checked(plan: ServingPlan, mesh, config: Config) -> ServingPlan:
    """`plan` bound to `mesh` once checked against the model `config` there (`ServingPlan.bind`'s check)."""
    lay = plan
    if lay.layout == "single":
        return lay
    if mesh is None:
        raise ValueError(f"layout {lay.layout!r} needs a mesh: pass mesh=qwen35_lib.plan.make_mesh() (the devices "
                         "as ('chip', 'core')), or run it under `with jax.set_mesh(mesh):`")
    missing = set(AXES) - set(mesh.axis_names)
    if missing:
        raise ValueError(f"layout {lay.layout!r} needs mesh axes {AXES}; this mesh has {mesh.axis_names}: build it "
                         "with qwen35_lib.plan.make_mesh()")
    n = axis_size(mesh, AXES)
    if lay.devices is not None and n != lay.devices:
        raise ValueError(f"layout {lay.layout!r} is the {lay.devices}-device instance of {lay.general!r}; this mesh "
                         f"has {n} devices: use layout {lay.general!r} (its sizes come from the mesh)")
    lay = dataclasses.replace(lay, mesh_shape=tuple((a, int(n)) for a, n in dict(mesh.shape).items()))
    kv = axis_size(mesh, lay.axes("kv_heads"))
    heads = config.num_kv_heads * lay.kv_replication(config)
    if heads % kv and not lay.kv_replicated:  # tp_kvrep keeps what does not divide whole on every device
        dp_ep, kvrep = ("dp8_ep8", "tp8_kvrep") if n == 8 else ("dp_ep", "tp_kvrep")
        raise ValueError(
            f"{config.num_kv_heads} KV heads cannot be split over {kv} devices of axes {lay.axes('kv_heads')} "
            f"(layout {lay.layout!r}: {config.num_kv_heads}/{kv} heads per device); use layout {dp_ep!r} or "
            f"replicate KV heads with {kvrep!r} (each device then keeps the one its query heads read: "
            f"{kv // math.gcd(kv, config.num_kv_heads)}x the KV-cache memory of an even split)")
    if heads % kv:  # tp_kvrep that cannot duplicate evenly: KV heads whole on every device
        lay = dataclasses.replace(lay, kv_whole=True)
    ep = lay.ep
    if lay.moe == "ep" and config.num_experts % ep:
        raise ValueError(f"{config.num_experts} experts cannot be split evenly over {ep} devices (expert "
                         f"parallelism over {lay.ep_axes}): use an expert count that is a multiple of {ep}, "
                         "or a tensor-parallel layout ('tp_kvrep')")
    tp = axis_size(mesh, lay.tp_axes)
    if lay.moe == "tp" and config.moe_ffn % tp:
        raise ValueError(f"expert FFN size {config.moe_ffn} cannot be split over {tp} devices (layout "
                         f"{lay.layout!r}); use an EP layout ('dp_ep')")
    if lay.moe == "tp" and config.expert_dtype and (config.moe_ffn // config.fp8_block_size) % tp:
        raise ValueError(f"FP8 expert scales ({config.moe_ffn // config.fp8_block_size} blocks of "
                         f"{config.fp8_block_size} along the FFN) cannot be split over {tp} devices: use "
                         "expert_dtype=None or an EP layout ('dp_ep')")
    problem = lay.collective_flags_problem()
    if problem:
        raise ValueError(problem)
    return lay


__all__ = ["LAYOUT_PLANS", "SINGLE", "ServingPlan", "get_layout", "kv_copies", "kv_heads_per_device",
           "micro_batches"]
