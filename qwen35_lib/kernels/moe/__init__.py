"""The `moe_matmul` slot: the routed experts' grouped SwiGLU (`xla`, `pallas`, `native`), and `fused_ep`, the EP MoE
layer as one Pallas kernel."""
