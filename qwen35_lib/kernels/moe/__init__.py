"""The `moe_matmul` slot: the routed experts' grouped SwiGLU, and `fused_ep`, the EP MoE layer as one Pallas kernel.

The slot's implementations, each a registry name a plan's `moe_kernel` may give (`NAMES`; the cost model
prices each under the same name, `costmodel.ops.Pricing.moe_impl`):

| name         | module   | what it is                                          | who runs it                          |
|--------------|----------|-----------------------------------------------------|--------------------------------------|
| `ragged_dot` | `xla`    | `jax.lax.ragged_dot` twice: the reference twin      | GPUs; the xla family off the CPU     |
| `loop`       | `xla`    | a loop over the experts hit, in tiles of their rows | the CPU where `native` cannot build  |
| `capacity`   | `xla`    | expert-major slots, one batched matmul (dropless)   | the MTP head (`bench.mtp.HEAD_PLAN`) |
| `pallas`     | `pallas` | one Pallas TPU kernel, experts read in place        | TPUs; the pallas family              |
| `native`     | `native` | the C++ handler on XLA:CPU's threads (else `loop`)  | the CPU                              |

`bench kernels` also times forms that are no slot implementation (`bench.kernels_moe`: `tiled`, capacity's fallback;
`blocked`, the loop at decode sizes; JAX's megablox `gmm`).
"""

NAMES = ("ragged_dot", "loop", "capacity", "pallas", "native")  # the table above (tests/kernels/test_registry.py)
