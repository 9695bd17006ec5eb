"""The `gdn` slot side by side: Pallas kernels (and on the CPU the native C++ ones, `kernels.gdn.native`) vs the XLA
reference, at CPU size (and TPU7x compile costs).

`gdn_rows` times both implementations on the same inputs in one run (interleaved, medians; see `timing`):
- `prefill`: the dense protocol over rows of `prefill_tokens` tokens (chunk kernel vs XLA's chunked scan);
- `decode`: the dense protocol with one token per row (decode kernel vs XLA's recurrent step);
- `mixed`: the ragged protocol, decodes next to prefill chunks that continue sequences from their slots.
Off a TPU the Pallas kernels run in interpret mode: their times say what the interpreter costs on this CPU,
nothing about a TPU (every row carries `mode`). `gdn_tpu_cost_rows` compiles both implementations for one
TPU7x core at the model's shapes and reports XLA's `cost_analysis` (a prediction, not a measurement): a
Mosaic kernel counts as its operand and result bytes (the aliased slot pool whole) plus the FLOPs of its
`CostEstimate`; XLA's own loops (the reference's scan over chunks) count one trip, so its FLOPs undercount.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from qwen35_lib.bench.timing import measure
from qwen35_lib.config import get_config
from qwen35_lib.engine.batch import SeqWork, pack
from qwen35_lib.kernels import get
from qwen35_lib.kernels.gdn import native as gdn_native
from qwen35_lib.kernels.gdn import pallas as gdn_pallas
from qwen35_lib.kernels.gdn import xla as gdn_xla
from qwen35_lib.kernels.native import build as native


def random_gdn_inputs(key, lead: tuple[int, ...], Hk: int, Hv: int, dk: int, dv: int, dtype=jnp.float32):
    """q, k [*lead, Hk, dk], v [*lead, Hv, dv] in `dtype`; g <= 0, beta in (0, 1) [*lead, Hv] float32."""
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (*lead, Hk, dk)).astype(dtype)
    k = jax.random.normal(ks[1], (*lead, Hk, dk)).astype(dtype)
    v = jax.random.normal(ks[2], (*lead, Hv, dv)).astype(dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (*lead, Hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (*lead, Hv)))
    return q, k, v, g, beta


def gdn_inputs(cfg, lead: tuple[int, ...], dtype, seed: int):
    """`random_gdn_inputs` at `cfg`'s GDN head counts and sizes."""
    return random_gdn_inputs(jax.random.key(seed), lead, cfg.gdn_num_k_heads, cfg.gdn_num_v_heads,
                             cfg.gdn_k_head_dim, cfg.gdn_v_head_dim, dtype)


def _native_here() -> bool:
    """The CPU handlers (`gdn_native`) run here: a CPU backend and the library built."""
    return jax.default_backend() == "cpu" and native.load(gdn_native.LIBRARY) is not None


def gdn_case(cfg, case: str, prefill_tokens: int, decode_batch: int, dtype, seed: int):
    """(description, {impl: zero-arg callable}, mask of outputs to compare or None) for one case."""
    Hv, dk, dv = cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    state = lambda n: 0.3 * jax.random.normal(jax.random.key(seed + 1), (n, Hv, dk, dv))
    if case in ("prefill", "decode"):
        B, T = (1, prefill_tokens) if case == "prefill" else (decode_batch, 1)
        args = (*gdn_inputs(cfg, (B, T), dtype, seed), state(B))
        fns = {"xla": jax.jit(gdn_xla.gdn_xla), "pallas": jax.jit(gdn_pallas.gdn_dense_pallas)}
        if _native_here():
            fns["native"] = jax.jit(gdn_native.gdn_dense_native)
        return f"B={B} T={T}", {n: partial(f, *args) for n, f in fns.items()}, None
    if case != "mixed":
        raise ValueError(f"unknown gdn bench case {case!r}; cases are prefill, decode, mixed")
    # decode_batch decodes continuing their sequences + two prompts continuing mid-sequence (ragged ends)
    D = decode_batch
    n1, n2 = prefill_tokens // 2 + 5, prefill_tokens // 2 - 40
    T = D + 64 * (-(-n1 // 64) - (-n2 // 64))
    decodes = [SeqWork([1], 50 + i, [1], 1 + i) for i in range(D)]
    prefills = [SeqWork([1] * n1, 64, [1], D + 1), SeqWork([1] * n2, 0, [1], D + 2)]
    _, meta = pack(decodes, prefills, D=D, T=T, S=D + 2, max_pages=1, chunk=64)
    meta = jax.tree.map(jnp.asarray, meta)
    valid = (meta.token_seq >= 0)[:, None]  # [T, 1]
    q, k, v, g, beta = gdn_inputs(cfg, (T,), dtype, seed)
    args = (q, k, v, jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0), state(D + 3), meta)
    fns = {"xla": jax.jit(gdn_xla.gdn_ragged_xla), "pallas": jax.jit(gdn_pallas.gdn_ragged_pallas)}
    if _native_here():
        fns["native"] = jax.jit(get("gdn", "native").ragged)
    return (f"{D} decodes + prefills of {n1} (mid-sequence) and {n2} tokens, T={T}",
            {n: partial(f, *args) for n, f in fns.items()}, meta.token_seq >= 0)


def gdn_rows(model: str = "qwen3.5-mini", cases: tuple[str, ...] = ("prefill", "decode", "mixed"),
             prefill_tokens: int = 512, decode_batch: int = 32, dtype: str = "bfloat16", repeats: int = 3,
             settle: int = 1, seed: int = 0) -> list[dict]:
    """Time the Pallas GDN kernels (and on the CPU the native ones) against the XLA reference, side by side, one row
    per (case, implementation).

    1. For each case build inputs at `model`'s GDN shapes (q, k, v in `dtype`; g, beta and state float32).
    2. `measure` both implementations interleaved (warm-up compiles first; `repeats` timed calls, median).
    3. Compare outputs (o, at real tokens) with the XLA reference.
    Row keys: kernel ("gdn"), case, shape, implementation, mode ("xla" | "pallas interpret (numerics only, not a
    TPU time)" | "pallas compiled"), backend, median_ms, min_ms, speedup_vs_xla (xla median / this median),
    max_abs_diff_vs_xla, heads (Hk, Hv, dk, dv), dtype.
    """
    cfg = get_config(model)
    dt = jnp.dtype(dtype)
    interpret = jax.default_backend() != "tpu"
    rows = []
    for case in cases:
        shape, candidates, mask = gdn_case(cfg, case, prefill_tokens, decode_batch, dt, seed)
        timings, outputs = measure(candidates, repeats=repeats, settle=settle, desc=f"gdn {case}")
        ref = outputs["xla"][0].astype(jnp.float32)
        for name, t in timings.items():
            diff = jnp.abs(outputs[name][0].astype(jnp.float32) - ref)
            diff = diff if mask is None else diff[mask]
            mode = name if name == "xla" else "native (C++ on the CPU)" if name == "native" else (
                "pallas interpret (numerics only, not a TPU time)" if interpret else "pallas compiled")
            rows.append({
                "kernel": "gdn", "case": case, "shape": shape, "implementation": name, "mode": mode,
                "backend": jax.default_backend(), "median_ms": t.median * 1e3, "min_ms": t.min * 1e3,
                "speedup_vs_xla": timings["xla"].median / t.median, "max_abs_diff_vs_xla": float(diff.max()),
                "heads": [cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim],
                "dtype": dtype,
            })
    return rows


def gdn_tpu_cost_rows(model: str = "qwen3.5-397b-a17b", prefill_tokens: int = 4096, decode_batch: int = 64,
                      state_dtype: str = "float32") -> list[dict]:
    """XLA's predicted bytes and FLOPs for one GDN layer's delta rule on one TPU7x core, Pallas vs XLA.

    1. Compile `dense` for prefill (1 row of `prefill_tokens`) and decode (`decode_batch` rows of 1 token) at
       `model`'s shapes, bf16 activations, for `tpu7x:2x2x1` device 0 (needs libtpu; nothing runs).
    2. Report `cost_analysis()` bytes accessed and FLOPs (caveats in the module docstring) and
       `memory_analysis()` temporaries. A prediction from the compiler, labelled so.
    """
    from qwen35_lib.aot import topology_devices

    cfg = get_config(model)
    one = jax.sharding.SingleDeviceSharding(topology_devices()[0])
    Hk, Hv, dk, dv = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    rows = []
    for case, (B, T) in (("prefill", (1, prefill_tokens)), ("decode", (decode_batch, 1))):
        sds = lambda *shape, dt="bfloat16": jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=one)
        args = (sds(B, T, Hk, dk), sds(B, T, Hk, dk), sds(B, T, Hv, dv), sds(B, T, Hv, dt="float32"),
                sds(B, T, Hv, dt="float32"), sds(B, Hv, dk, dv, dt=state_dtype))
        for name, fn in (("xla", gdn_xla.gdn_xla), ("pallas", partial(gdn_pallas.gdn_dense_pallas, interpret=False))):
            compiled = jax.jit(fn).lower(*args).compile()
            cost = compiled.cost_analysis()
            rows.append({
                "kernel": "gdn", "case": case, "shape": f"B={B} T={T}", "implementation": name, "model": model,
                "mode": "tpu7x compile (prediction)", "bytes_accessed": cost.get("bytes accessed"),
                "flops": cost.get("flops"),
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            })
    return rows
