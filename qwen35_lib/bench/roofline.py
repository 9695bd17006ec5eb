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


# --- per component (the profile table's floors, `bench.profile`) -----------------------------------------------


@functools.lru_cache(maxsize=8)
def _counts(cfg: Config) -> dict[str, tuple[int, int]]:
    """(parameters, bytes) of the weights each component reads: the projections (every `linear`: attention and
    GDN in/out, router, shared expert) and the LM head ("dense matmuls"), the routed experts ("MoE", all of them),
    and the small rest (norms, convs, gates: "other")."""
    w = abstract_weights(cfg)
    layers = w["layers"]
    size = lambda a: int(np.prod(a.shape))
    pb = lambda leaves: (sum(map(size, leaves)), sum(size(a) * jnp.dtype(a.dtype).itemsize for a in leaves))
    proj = [a for name, a in layers["attn"].items() if name.startswith("w_")]
    proj += [a for name, a in layers["gdn"].items() if name.startswith("w_")]
    proj += [layers["moe"][n] for n in ("router", "shared_gate_up", "shared_down", "shared_gate")]
    experts = [layers["moe"][n] for n in EXPERT_LEAVES]
    return {"proj": pb(proj), "lm_head": pb([w["lm_head"]]), "experts": pb(experts)}


def step_components(cfg: Config, q_lens, kv_lens, head_rows: int) -> dict[str, dict[str, float]]:
    """The least bytes read and FLOPs of one step, per profile component (`bench.profile.COMPONENTS`).

    q_lens, kv_lens: per sequence, its new tokens and its context after the step (a decode: 1 and the context; a
    prefill of T tokens: T and T); head_rows: the positions the LM head runs on (the engine: one a sequence; a
    full forward: every token). Per component:
    - dense matmuls: every projection weight and the LM head read once; 2 x their parameters x tokens (rows);
    - MoE: the routed experts the tokens can touch (expected distinct experts per layer under uniform routing)
      read once; 2 x k experts' parameters x tokens;
    - attention: each sequence's K/V context read once (model dtype); QKᵀ and PV over the causal context;
    - GDN: each sequence's state read and written; per token the recurrent update (decay, kᵀS, the rank-1
      update, qᵀS: 8 Hv dk dv FLOPs), the least any form of the delta rule does;
    - sampling: the logits [sequences, V] float32 read once.
    Returns {component: {"bytes": ..., "flops": ...}}.
    """
    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    live = q_lens > 0
    q_lens, kv_lens = q_lens[live], kv_lens[live]
    tokens, seqs = int(q_lens.sum()), int(len(q_lens))
    c = _counts(cfg)
    item = jnp.dtype(cfg.dtype).itemsize
    n_attn, n_gdn = cfg.layer_types.count(FULL), cfg.layer_types.count(LINEAR)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** tokens) if tokens else 0.0
    seen = float(np.sum(q_lens * kv_lens - q_lens * (q_lens - 1) / 2))  # Σ over new tokens of the keys each sees
    state = cfg.gdn_num_v_heads * cfg.gdn_k_head_dim * cfg.gdn_v_head_dim
    return {
        "dense matmuls": {"bytes": c["proj"][1] + c["lm_head"][1],
                          "flops": 2.0 * (c["proj"][0] * tokens + c["lm_head"][0] * head_rows)},
        "MoE": {"bytes": c["experts"][1] * touched / E, "flops": 2.0 * c["experts"][0] * k / E * tokens},
        "attention": {"bytes": float(np.sum(kv_lens)) * 2 * cfg.num_kv_heads * cfg.head_dim * item * n_attn,
                      "flops": 4.0 * cfg.num_q_heads * cfg.head_dim * seen * n_attn},
        "GDN": {"bytes": 2.0 * seqs * state * jnp.dtype(cfg.gdn_state_dtype).itemsize * n_gdn,
                "flops": 8.0 * state * tokens * n_gdn},
        "sampling": {"bytes": 4.0 * seqs * cfg.vocab_size, "flops": 0.0},
    }


def component_floors(parts: dict[str, dict[str, float]], bandwidth: float, peak: float) -> dict[str, dict]:
    """`step_components` as floors in ms: bytes / bandwidth (bytes/s) and FLOPs / peak (FLOP/s)."""
    return {name: {"bytes": p["bytes"], "flops": p["flops"], "bytes_ms": 1e3 * p["bytes"] / bandwidth,
                   "flops_ms": 1e3 * p["flops"] / peak} for name, p in parts.items()}
