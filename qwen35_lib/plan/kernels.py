"""The kernel choices a plan makes, as data: the kernel families of the stages, and each backend's default
implementation of every slot ("auto"). The implementations themselves register in `qwen35_lib.kernels.registry`,
which reads these tables.

| family   | attention | gdn  | moe_matmul                              | permute |
|----------|-----------|------|-----------------------------------------|---------|
| `xla`    | xla       | xla  | `loop` on CPU, `ragged_dot` elsewhere   | xla     |
| `pallas` | pallas    | pallas | pallas                                | pallas  |
"""

from __future__ import annotations

SLOTS = ("attention", "gdn", "moe_matmul", "permute")
KERNEL_FIELDS = {"attention": "attention_kernel", "gdn": "gdn_kernel", "moe_matmul": "moe_kernel",
                 "permute": "permute_kernel"}  # slot -> ServingPlan field
# "auto" by backend. CPU choices come from `python -m qwen35_lib.bench kernels` (data/kernel_choice_cpu.json),
# except the MoE's `loop`, chosen from `bench engine` side by side with `capacity` (decode step 70.6 -> 45.7 ms):
# the stored file predates `loop` and still names `capacity`; rerun `bench kernels --write-choice` to refresh it.
BACKEND_DEFAULTS: dict[str, dict[str, str]] = {
    "cpu": {"attention": "xla", "gdn": "xla", "moe_matmul": "loop", "permute": "xla"},
    # TPU: the Pallas kernels (compiled for tpu7x in the tests; not yet timed on a TPU). The Pallas permute moves
    # rows with DMAs of whole [8, 128] tiles, which needs a relayout of the activations; XLA's gather does not.
    "tpu": {"attention": "pallas", "gdn": "pallas", "moe_matmul": "pallas", "permute": "xla"},
    "gpu": {"attention": "xla", "gdn": "xla", "moe_matmul": "ragged_dot", "permute": "xla"},
}
# A stage's kernel family, slot by slot: "xla" the XLA twins (the MoE's grouped matmul as XLA:CPU runs it fastest,
# `loop`, and `ragged_dot` elsewhere), "pallas" every slot's Pallas kernel (interpret mode off a TPU).
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
    moe = "loop" if backend == "cpu" else "ragged_dot"
    return {f: (moe if slot == "moe_matmul" else "xla") for slot, f in KERNEL_FIELDS.items()}


__all__ = ["BACKEND_DEFAULTS", "KERNEL_FIELDS", "FAMILIES", "SLOTS", "family_kernels"]
