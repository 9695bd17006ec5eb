"""The serving plan: one frozen, hashable record of how a model is served on a mesh.

A `ServingPlan` names a layout (how attention, GDN and the MoE are placed: the logical-axis rules of
`plan.layouts.LAYOUT_RULES`), the MoE routing of an EP layout, the collective options, the kernel family (resolved
per backend by `plan.kernels.family_kernels`) and the cache dtypes. Sizes are never written in a plan: they come
from the mesh it is bound to, so the general layouts run on any `('chip', 'core')` mesh whose sizes divide (1, 2,
4, 8, 16 devices). A plan's name is its layout's for a layout plan (`get_layout`), or a stage's (`plan.stages`).
The record is what is asked; `plan.bind(mesh, config)` checks it against a model on a mesh, once, and returns a
`plan.bound.BoundPlan` (sizes, platform, each kernel slot resolved, the placed config, the cache dtypes), or refuses
it naming the constraint and the fix; every entry point (the engine, the ahead-of-time compiles, the cost model)
binds once and hands the bound plan down.
"""

from __future__ import annotations

import dataclasses

from qwen35_lib.config import Config
from qwen35_lib.plan.bound import BoundPlan, bind, kv_copies, kv_heads_per_device
from qwen35_lib.plan.kernels import FAMILIES, resolve
from qwen35_lib.plan.layouts import GENERAL, INSTANCES, LAYOUT_RULES, LAYOUTS, ROUTINGS, Axes


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
    kv_dtype: str | None = None  # paged KV cache; None: the entry point's (`bind(..., kv_dtype=)`), else the model's
    gdn_state_dtype: str | None = None  # recurrent GDN state (`BoundPlan.place` sets it); None: the config's
    rs_micro_batches: int | None = None  # hierarchical_rs: micro-batches; None: tpu-inference's rule by tokens
    capacity_factor: float | None = None  # all_to_all: None = dropless; else slots per device = f * mean (drops)
    # each kernel slot's implementation (`qwen35_lib.kernels`); None or "auto": the family's (`kernels`), else the
    # platform's default (`plan.kernels.BACKEND_DEFAULTS`). `bind` resolves them for the mesh's platform (the
    # BoundPlan's `kernel(slot)`); the record keeps what was asked.
    attention_kernel: str | None = None
    gdn_kernel: str | None = None
    moe_kernel: str | None = None
    permute_kernel: str | None = None
    dense_kernel: str | None = None  # the dense projections; "pallas" reads each layer's weights in place
    # replicate: each routed row sent home by remote DMA from the grouped-matmul kernel as its row tile finishes
    # (`kernels.moe.fused_ep`, always the Pallas FFN), instead of a local combine and the reduce-scatter
    fused_combine: bool = False

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
        return LAYOUT_RULES[self.general].rules

    @property
    def moe(self) -> str:  # "local" | "tp" (expert FFN split, all-reduce) | "ep" (experts split, routed)
        return LAYOUT_RULES[self.general].moe

    @property
    def kv_replicated(self) -> bool:
        return LAYOUT_RULES[self.general].kv_replicated

    @property
    def summary(self) -> str:
        return LAYOUT_RULES[self.general].summary

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
        if self.fused_combine and not self.collective_flags_apply:
            return ("fused_combine (the combine by remote DMA from the grouped-matmul kernel) applies to data-parallel "
                    f"EP layouts ('dp_ep', 'dp_tp2_ep') with routing 'replicate'; got layout {self.layout!r}, routing "
                    f"{self.routing!r}")
        if self.fused_combine and self.hierarchical_rs:
            return "fused_combine replaces the reduce-scatter: set hierarchical_rs=False with it"
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

    # --- binding (sizes, kernels, the placed config: `plan.bound.BoundPlan`) ---
    def bind(self, mesh, config: Config | None = None, platform: str | None = None,
             kv_dtype: str | None = None) -> BoundPlan:
        """This plan as it runs on `mesh` (a Mesh or AbstractMesh; None: one device) for `config`, on `platform`
        (default: the mesh's devices', else JAX's default backend): a `BoundPlan` with the mesh's sizes, every kernel
        slot resolved, the config placed and the cache dtypes (`kv_dtype`: the entry point's where the plan names
        none). With `config`, the one check of the plan against the model there first (a ValueError naming the
        constraint it breaks and the fix). Every entry point (the engine, the ahead-of-time compiles, the cost
        model) binds once and hands the bound plan down; this record is left as asked."""
        return bind(self, mesh, config, platform, kv_dtype)

    def bound(self, mesh, config: Config | None = None, platform: str | None = None,
              kv_dtype: str | None = None) -> BoundPlan:
        """`bind`: a plan is not bound until it is (`BoundPlan.bound` keeps one bound there already)."""
        return bind(self, mesh, config, platform, kv_dtype)

    @property
    def platform(self) -> None:
        """None: an unbound plan runs on JAX's default backend (a `BoundPlan` names the platform it was bound for)."""
        return None

    @property
    def mesh_shape(self) -> None:
        """None: an unbound plan has no sizes (a `BoundPlan` has its mesh's)."""
        return None

    def kernel(self, slot: str) -> str:
        """The implementation of kernel `slot` (`plan.kernels.SLOTS`) this unbound plan runs on JAX's default
        backend (`BoundPlan.kernel`: as bound)."""
        import jax

        return resolve(self, jax.default_backend())[slot]

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

    # sizes on a mesh, asked of an unbound plan (a bound one has them: `BoundPlan.dp`, `.kv_replication(config)`)
    def dp_size(self, mesh) -> int:
        """Data-parallel ranks on `mesh`."""
        return self.bind(mesh).dp

    def kv_replication(self, config: Config, mesh) -> int:
        """Copies of each KV head in the weights on `mesh`: `kv_copies` under `tp_kvrep`, else 1."""
        return self.bind(mesh).kv_replication(config)

    def kv_heads_per_device(self, config: Config, mesh) -> int:
        """KV heads a device stores on `mesh` (`BoundPlan.kv_heads_per_device`)."""
        return self.bind(mesh).kv_heads_per_device(config)

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


LAYOUT_PLANS: dict[str, ServingPlan] = {name: ServingPlan(name, name, kernels=None) for name in LAYOUTS}
SINGLE = LAYOUT_PLANS["single"]  # one device, each kernel slot the platform's default


def get_layout(name: str) -> ServingPlan:
    """The layout plan `name` (any of config.LAYOUTS: an 8-device instance or a general form)."""
    if name not in LAYOUT_PLANS:
        raise ValueError(f"unknown layout {name!r}; use one of {LAYOUTS}")
    return LAYOUT_PLANS[name]


__all__ = ["LAYOUT_PLANS", "SINGLE", "ServingPlan", "get_layout", "kv_copies", "kv_heads_per_device",
           "micro_batches"]
