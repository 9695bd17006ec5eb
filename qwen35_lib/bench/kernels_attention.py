"""Attention side of `python -m qwen35_lib.bench kernels`: the Pallas ragged paged attention and the CPU's XLA
attention by items vs their XLA twin.

`attention_rows(...)` times the three `paged` implementations of the `attention` slot side by side on ragged batches
packed by the engine's `pack` at the model's attention shapes, and returns one row per (case, implementation).
Off a TPU the Pallas kernel runs in interpret mode: its time is then a numerics-only figure (a Python-level
emulation of the TPU program), labelled so in every row, and says nothing about TPU speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.bench.timing import measure
from qwen35_lib.config import get_config
from qwen35_lib.engine.batch import SeqWork, pack
from qwen35_lib.kernels.attention.pallas import paged_attention_pallas
from qwen35_lib.kernels.attention.xla import paged_attention_items, paged_attention_xla

# name -> (decode context lengths, prefill chunks (start position, new tokens))
CASES = {
    "decode 32 x ctx 1024": ([1024] * 32, []),
    "mixed 8 decodes + 2 x 256 prefill": ([512] * 8, [(0, 256), (256, 256)]),
}


def attention_rows(model: str = "qwen3.5-mini", cases: dict | None = None, page_size: int = 16,
                   kv_dtype: str | None = None, repeats: int = 3, seed: int = 0) -> list[dict]:
    """Rows {kernel, case, implementation, mode, tokens, keys_attended, median_ms, tokens_per_s,
    useful_gflop_per_s, throughput_ratio_vs_xla, max_abs_diff_vs_xla, ...}, three per case (xla, items, pallas).

    1. pack each case's decodes and prefill chunks into one ragged batch (shuffled pages, a random cache,
       `kv_dtype` None = the model dtype, "float8_e4m3fn" = FP8 with per-token scales)
    2. time `paged_attention_xla`, `paged_attention_items` and `paged_attention_pallas` interleaved
       (`timing.measure`)
    3. useful FLOPs = 4 * Hq * d * (keys each query sees, causal): the same count for both implementations.
    """
    cfg = get_config(model)
    Hq, Hkv, d, ps = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, page_size
    dt = jnp.dtype(cfg.dtype)
    backend = jax.default_backend()
    mode = "compiled (TPU)" if backend == "tpu" else f"interpret ({backend.upper()}: numerics only, not a speed)"
    rows = []
    for name, (decodes, prefills) in (cases or CASES).items():
        rng = np.random.default_rng(seed)
        works, next_page = [], 1
        for start, n in [(L - 1, 1) for L in decodes] + list(prefills):
            need = -(-(start + n) // ps)
            works.append(SeqWork([0] * n, start, list(range(next_page, next_page + need)), 0))
            next_page += need
        P = next_page
        perm = np.concatenate([[0], rng.permutation(np.arange(1, P))])  # shuffled pages: real gathers
        works = [w._replace(pages=[int(perm[p]) for p in w.pages]) for w in works]
        T = max(len(decodes), 1) + sum(-(-n // 64) * 64 for _, n in prefills)
        _, meta = pack(works[: len(decodes)], works[len(decodes):], D=max(len(decodes), 1), T=T, S=len(works),
                       max_pages=max(len(w.pages) for w in works), chunk=64)
        keys = jax.random.split(jax.random.key(seed), 2)
        q = jax.random.normal(keys[0], (T, Hq, d), jnp.float32).astype(dt)
        kv = jax.random.normal(keys[1], (P, ps, 2 * Hkv * d), jnp.float32)
        scales = None
        if kv_dtype and jnp.dtype(kv_dtype).itemsize == 1:
            scales = jnp.full((P, 2 * Hkv, ps), 1 / 16, jnp.float32)
            kv = (kv * 16).astype(kv_dtype)  # e4m3 holds up to 448: 28 sigma
        else:
            kv = kv.astype(kv_dtype or dt)
        args = (q, kv, scales, *(jnp.asarray(a) for a in (meta.page_table, meta.token_seq, meta.positions)))
        fns = {"xla": jax.jit(paged_attention_xla), "items": jax.jit(paged_attention_items),
               "pallas": paged_attention_pallas}
        timings, outs = measure({k: (lambda f=f, a=args: f(*a)) for k, f in fns.items()}, repeats=repeats,
                                desc=f"attention {name}")
        valid = meta.token_seq >= 0
        diff = {k: float(np.max(np.abs(np.asarray(outs[k], np.float32)[valid]
                                       - np.asarray(outs["xla"], np.float32)[valid]))) for k in fns}
        seen = int(np.sum(meta.positions[valid] + 1))  # keys the valid queries attend to
        flops = 4 * Hq * d * seen
        for impl in fns:
            sec = timings[impl].median
            rows.append({
                "kernel": "attention", "case": name, "implementation": impl,
                "mode": mode if impl == "pallas" else f"XLA ({backend})",
                "model": model, "dtype": str(dt), "kv_dtype": str(kv.dtype), "page_size": ps,
                "tokens": int(valid.sum()), "sequences": len(works), "keys_attended": seen,
                "median_ms": 1e3 * sec, "tokens_per_s": float(valid.sum() / sec),
                "useful_gflop_per_s": flops / sec / 1e9,
                "throughput_ratio_vs_xla": timings["xla"].median / sec,
                "max_abs_diff_vs_xla": diff[impl],
            })
    return rows
