"""This machine's rooflines, measured in the benchmark's own run, and what a step of the model must do.

- `copy_bandwidth()`: bytes/s of a numpy copy of a 256 MiB float32 array (read + write traffic, the STREAM copy
  convention; best of a few), the memory roofline a CPU decode step is held to;
- `matmul_flops()`: FLOP/s of XLA:CPU's float32 [1024, 1024] x [1024, 1024] matmul (the kernel our prefill's
  projections and experts run on; best of a few), the compute roofline of a prefill;
- `decode_bytes(cfg, contexts)`: the bytes one decode step of len(contexts) sequences must read at least: every
  non-expert weight, the experts the batch can touch (expected distinct experts per layer under uniform routing),
  each sequence's KV context and GDN state (state read and written);
- `prefill_flops(cfg, batch, seq)`: the FLOPs of one prefill of batch x seq tokens (active weights, causal
  attention scores, the GDN's chunked delta rule left out: a few percent at these sizes).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.config import FULL, LINEAR, Config
from qwen35_lib.weights import abstract_weights

EXPERT_LEAVES = ("w_gate_up", "w_down")


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by the best of `repeats` numpy copies of a `mib` MiB array."""
    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` jitted float32 [n, n] x [n, n] matmuls on the default (CPU) backend."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=8)
def _weight_bytes(cfg: Config) -> tuple[int, int]:
    """(bytes of every weight but the embedding and the routed experts, bytes of the routed experts)."""
    w = abstract_weights(cfg)
    experts = _bytes({k: w["layers"]["moe"][k] for k in EXPERT_LEAVES})
    return _bytes(w) - experts - _bytes(w["embed"]), experts


def decode_bytes(cfg: Config, contexts: list[int]) -> dict[str, float]:
    """The least bytes one decode step of len(contexts) sequences (context lengths after the step) reads."""
    dense, experts = _weight_bytes(cfg)
    dense += len(contexts) * cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize  # the embedding rows
    n, E, k = len(contexts), cfg.num_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** n)  # expected distinct experts per layer
    item = jnp.dtype(cfg.dtype).itemsize
    kv = sum(contexts) * 2 * cfg.num_kv_heads * cfg.head_dim * item * cfg.layer_types.count(FULL)
    state = 2 * n * cfg.gdn_num_v_heads * cfg.gdn_k_head_dim * cfg.gdn_v_head_dim * \
        jnp.dtype(cfg.gdn_state_dtype).itemsize * cfg.layer_types.count(LINEAR)
    out = {"dense_weights": dense, "experts": experts * touched / E, "kv_cache": kv, "gdn_state": state}
    out["total"] = sum(out.values())
    return out


def prefill_flops(cfg: Config, batch: int, seq: int) -> float:
    """FLOPs of one prefill: 2 x active weights per token (k routed experts + everything else but the
    embedding), plus causal attention (QK^T and PV over the positions before each token)."""
    w = abstract_weights(cfg)
    count = lambda tree: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))
    experts = count({k: w["layers"]["moe"][k] for k in EXPERT_LEAVES})
    active = count(w) - count(w["embed"]) - experts + experts * cfg.num_experts_per_tok / cfg.num_experts
    attn = 2 * 2 * cfg.num_q_heads * cfg.head_dim * (seq * (seq + 1) / 2) * cfg.layer_types.count(FULL)
    return batch * (2 * active * seq + attn)
