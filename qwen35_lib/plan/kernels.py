"""The kernel choices a plan makes, as data: the kernel families of the stages, and each backend's default
implementation of every slot ("auto"). The implementations themselves register in `qwen35_lib.kernels.registry`,
which reads these tables.

| family   | attention                | gdn                       | moe_matmul                       | permute | dense |
|----------|--------------------------|---------------------------|----------------------------------|---------|-------|
| `xla`    | items                    | `native` on CPU, else xla | `native` on CPU, else ragged_dot | xla     | xla   |
| `pallas` | pallas                   | pallas                    | pallas                           | pallas  | pallas|

Where the `xla` family is not XLA code: on the CPU two C++ XLA FFI handlers that XLA calls like any op, each
running its XLA twin where it cannot be built. The MoE's grouped matmul is `native` (`kernels/moe/native.py`;
else the XLA `loop`): XLA:CPU runs few-row expert matmuls at about half the memory bandwidth after copying each
expert, which no formulation in XLA ops avoided (the `kernels.moe.xla` docstrings). The GDN's decode step is `native`
(`kernels/gdn/native.py`; its prefill chunks stay XLA's): XLA:CPU's batched matrix-vector products over the state
cost about ten passes over it. The attention is XLA's on every backend, by items (`attention.xla.
paged_attention_items`: a page read once per run of a sequence's tokens in a block of 16, not once per token; the
twin where that would cost more, as at decode, where a token is its sequence's one). On a TPU the twin alone made
every prompt token of a mixed step read the batch's longest context: 78% of the dp_ep stage's priced mean step at
8k/1k, c512 (1,511 of 1,932 ms). qwen3.5-mini's attention shapes, float32, pages of 16, one layer's paged
attention alone, twin -> items in one run (decodes at context 1000): 7 decodes + a 128-token chunk at
position 512 45.4 -> 14.1 ms, 4 decodes + a 512-token prompt 138.0 -> 30.2 ms, 32 decodes + a 2,048-token prompt
2,267 -> 326 ms; 64 decodes + a 64-token chunk 47.6 -> 66.0 ms, where the twin runs (`ITEM_COST`).
"""

from __future__ import annotations

from qwen35_lib.plan.mesh import ALL

SLOTS = ("attention", "gdn", "moe_matmul", "permute", "dense")
KERNEL_FIELDS = {"attention": "attention_kernel", "gdn": "gdn_kernel", "moe_matmul": "moe_kernel",
                 "permute": "permute_kernel", "dense": "dense_kernel"}  # slot -> ServingPlan field
# "auto" by backend. CPU choices come from `python -m qwen35_lib.bench kernels` (data/kernel_choice_cpu.json),
# except the MoE's, chosen from `bench engine --moe-kernel` side by side: `loop` over `capacity` (decode step 70.6 ->
# 45.7 ms), then `native` (the C++ handler, `kernels/moe/native.py`; `loop` where it cannot be built) over `loop`
# (qwen3.5-mini 1k/1k N=8, float32: decode step 50.2 -> 22.3 ms, prefill step 387.7 -> 326.1 ms); the GDN's
# `native` (its decode step a C++ handler, `kernels/gdn/native.py`) over `xla` from the engine's compiled decode
# step alone (bench engine's configuration at 8 sequences: 21.5 -> 20.1 ms, 19.4 with `model.layer_loop`'s per-layer
# caches, which the handler updates in place). The stored file
# (2026-12-04) names `native` overall; in bfloat16 at 512 and 4,096 tokens XLA's batched `capacity` beat it on
# pre-sorted rows (54 vs 87 ms at 4,096), which the engine's fused path does not run.
BACKEND_DEFAULTS: dict[str, dict[str, str]] = {
    "cpu": {"attention": "items", "gdn": "native", "moe_matmul": "native", "permute": "xla", "dense": "xla"},
    # TPU: the Pallas kernels (compiled for tpu7x in the tests; not yet timed on a TPU). The Pallas permute moves
    # rows with DMAs of whole [8, 128] tiles, which needs a relayout of the activations; XLA's gather does not.
    # The dense projections read each layer's weights in place from the stacks (`kernels.dense.pallas`).
    "tpu": {"attention": "pallas", "gdn": "pallas", "moe_matmul": "pallas", "permute": "xla", "dense": "pallas"},
    "gpu": {"attention": "xla", "gdn": "xla", "moe_matmul": "ragged_dot", "permute": "xla", "dense": "xla"},
}
# A stage's kernel family, slot by slot: "xla" the XLA twins (on the CPU the attention by items, the GDN decode and
# the MoE's grouped matmul the native handlers; `ragged_dot` elsewhere), "pallas" every slot's Pallas kernel
# (interpret mode off a TPU).
FAMILIES = ("xla", "pallas")


def family_kernels(family: str, backend: str | None = None) -> dict[str, str]:
    """The ServingPlan kernel fields of a kernel family on `backend` (default: JAX's default backend)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; use one of {FAMILIES}")
    if family == "pallas":
        return dict.fromkeys(KERNEL_FIELDS.values(), "pallas")
    if backend is None:
        import jax

        backend = jax.default_backend()
    cpu = backend == "cpu"
    native = {"moe_matmul": "native" if cpu else "ragged_dot", "gdn": "native" if cpu else "xla",
              "attention": "items"}  # every backend: the twin where items would cost more
    return {f: native.get(slot, "xla") for slot, f in KERNEL_FIELDS.items()}


def resolve(plan, platform: str) -> dict[str, str]:
    """{slot: implementation} of a `ServingPlan` on `platform`: a slot's own name where the plan gives one (not None
    or "auto"), else its family's (`family_kernels`), else the platform's default (`BACKEND_DEFAULTS`); the dense
    projections XLA's where the plan splits the weights by heads (XLA partitions those dots). `bind` reads this
    once; the plan keeps what was asked."""
    family = family_kernels(plan.kernels, platform) if plan.kernels is not None else {}
    default = dict(BACKEND_DEFAULTS.get(platform, BACKEND_DEFAULTS["cpu"]))
    if plan.layout != "single" and plan.batch_axes != ALL:  # weights split by heads: XLA partitions the dots
        family, default = {**family, "dense_kernel": "xla"}, {**default, "dense": "xla"}
    asked = {slot: getattr(plan, f) for slot, f in KERNEL_FIELDS.items()}
    return {slot: asked[slot] if asked[slot] not in (None, "auto") else family.get(f, default[slot])
            for slot, f in KERNEL_FIELDS.items()}


__all__ = ["BACKEND_DEFAULTS", "KERNEL_FIELDS", "FAMILIES", "SLOTS", "family_kernels", "resolve"]
