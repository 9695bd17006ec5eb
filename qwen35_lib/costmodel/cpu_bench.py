"""Micro-benchmarks that measure this CPU's specs for the cost model (a second or two, cached per process).

The CPU runs of the engine compute in float32 on one XLA:CPU device; so do these measurements:
1. `matmul_flops`: a [512, 512] x [512, 512] float32 matmul chain (the size of qwen3.5-mini's projections),
   FLOPs / median seconds;
2. `memory_bytes_per_s`: the sum of a 64 MiB float32 array (a streaming read, as weights are read; a write of a
   fresh 64 MiB output would time the OS's page faults instead), bytes / median seconds;
3. `op_overhead_s`: a `fori_loop` of 256 steps, each one tiny dependent op chain on an [8, 64] array: what
   XLA:CPU spends per launched op when the op does almost no work, (seconds / steps) / ops per step;
4. `copy_bytes_per_s`: `x * 2 + 1` over the same 64 MiB into a fresh output (bytes read + bytes written /
   seconds): what a materialized copy (a sliced weight, a gathered tensor) costs, page faults included;
5. `small_matmul_flops`: a batched matmul with few rows per batch, [64, 32, 512] x [64, 512, 256] (the shape of
   the CPU MoE kernel's expert slots), FLOPs / seconds;
6. `vector_flops`: element-wise multiply-adds on a cache-resident [64, 1024] float32 array, 16 a step in one
   fusion, 64 steps in a `fori_loop` (the vector work of norms, softmax and the GDN recurrence, which runs on
   the same cores as the matmuls), FLOPs / seconds;
7. `dense_rows_flops`: the dense projections' dot with few rows, as the engine's steps run it past the native
   handler's rows (`kernels.dense.native.MAX_ROWS`): [R, 512] x [512, 1024] float32 (qwen3.5-mini's hidden size
   and its widest projection), 8 distinct weights a call, at each R of DENSE_ROWS; ((R, FLOPs / seconds), ...).
Each runs jitted, warmed up once, then timed `repeats` times; the median is kept. `measure` is cached per process;
`measure_now` measures again (a benchmark that times other work measures beside it, under the same load).
"""

from __future__ import annotations

import functools
import statistics
import time

DESCRIPTIONS = {
    "peak_flops": "float32 [512,512]x[512,512] matmul chain on XLA:CPU (qwen35_lib.costmodel.cpu_bench)",
    "hbm_bytes_per_s": "sum of a 64 MiB float32 array, a streaming read (qwen35_lib.costmodel.cpu_bench)",
    "op_overhead_s": "per-op time of a fori_loop of tiny dependent ops on [8,64] (qwen35_lib.costmodel.cpu_bench)",
    "copy_bytes_per_s": "x*2+1 over 64 MiB into a fresh output, read + write (qwen35_lib.costmodel.cpu_bench)",
    "small_matmul_flops": "float32 [64,32,512]x[64,512,256] batched matmul (qwen35_lib.costmodel.cpu_bench)",
    "vector_flops": "element-wise multiply-adds on a cache-resident float32 [64,1024] (qwen35_lib.costmodel.cpu_bench)",
    "dense_rows_flops": "float32 [R,512]x[512,1024] XLA dots at R = 16..256 rows (qwen35_lib.costmodel.cpu_bench)",
}
DENSE_ROWS = (16, 32, 64, 128, 256)  # rows of the few-rows dots (the peak's chain has 512)


def median_time(fn, *args, repeats: int = 5) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@functools.cache
def measure(repeats: int = 5) -> dict:
    """`measure_now(repeats)`, once per process."""
    return measure_now(repeats)


def measure_now(repeats: int = 5) -> dict:
    """{"matmul_flops", "memory_bytes_per_s", "op_overhead_s", "copy_bytes_per_s", "small_matmul_flops",
    "vector_flops", "dense_rows_flops"} of this machine, measured now (see the module doc)."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    n, chain = 512, 8
    a = jax.device_put(jnp.ones((n, n), jnp.float32) / n, cpu)

    @jax.jit
    def matmuls(x):
        for _ in range(chain):
            x = x @ a
        return x

    t_mm = median_time(matmuls, a, repeats=repeats)
    big = jax.device_put(jnp.ones((16 * 2**20,), jnp.float32), cpu)  # 64 MiB
    t_bw = median_time(jax.jit(jnp.sum), big, repeats=repeats)

    steps, ops_per_step = 256, 3
    w = jax.device_put(jnp.ones((64, 64), jnp.float32) / 64, cpu)

    @jax.jit
    def tiny(x):
        def body(i, x):
            y = x @ w  # op 1
            y = jnp.tanh(y) + jnp.sum(y, axis=0, keepdims=True)  # op 2 (fused elementwise + reduction)
            return jax.lax.sort(y, dimension=1)  # op 3
        return jax.lax.fori_loop(0, steps, body, x)

    t_ops = median_time(tiny, jax.device_put(jnp.ones((8, 64), jnp.float32), cpu), repeats=repeats)
    t_copy = median_time(jax.jit(lambda x: x * 2 + 1), big, repeats=repeats)
    xs = jax.device_put(jnp.ones((64, 32, 512), jnp.float32), cpu)
    ws = jax.device_put(jnp.ones((64, 512, 256), jnp.float32) / 512, cpu)
    t_small = median_time(jax.jit(lambda x, w: jnp.einsum("ecd,edf->ecf", x, w)), xs, ws, repeats=repeats)
    v_steps, fmas = 64, 16

    @jax.jit
    def fma_chain(x):
        def body(i, x):
            for _ in range(fmas):
                x = x * 0.999 + 0.001
            return x
        return jax.lax.fori_loop(0, v_steps, body, x)

    vec = jax.device_put(jnp.ones((64, 1024), jnp.float32), cpu)
    t_vec = median_time(fma_chain, vec, repeats=repeats)
    return {"matmul_flops": 2 * n**3 * chain / t_mm, "memory_bytes_per_s": big.nbytes / t_bw,
            "op_overhead_s": t_ops / (steps * ops_per_step), "copy_bytes_per_s": 2 * big.nbytes / t_copy,
            "small_matmul_flops": 2 * 64 * 32 * 512 * 256 / t_small,
            "vector_flops": 2 * fmas * v_steps * vec.size / t_vec,
            "dense_rows_flops": _dense_rows(cpu, repeats)}


@functools.cache
def _sum_of_dots():
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x, ws: sum(jnp.sum(x @ w) for w in ws))


def _dense_rows(cpu, repeats: int) -> tuple[tuple[int, float], ...]:
    """((R, FLOP/s), ...) of [R, 512] x [512, 1024] float32 dots, 8 distinct weights a call."""
    import jax
    import jax.numpy as jnp

    K, N, count = 512, 1024, 8
    ws = [jax.device_put(jnp.full((K, N), 1.0 / K / (i + 1), jnp.float32), cpu) for i in range(count)]
    out = []
    for R in DENSE_ROWS:
        x = jax.device_put(jnp.ones((R, K), jnp.float32), cpu)
        out.append((R, 2 * R * K * N * count / median_time(_sum_of_dots(), x, ws, repeats=repeats)))
    return tuple(out)


def median_of(measured: list[dict]) -> dict:
    """Each figure's median over several `measure_now` results (a table's: each row's), e.g. taken between the
    timed runs of a benchmark, so that the specs see the load the runs saw."""
    out = {}
    for key, first in measured[0].items():
        if isinstance(first, (tuple, list)):
            out[key] = tuple((r, statistics.median(m[key][i][1] for m in measured)) for i, (r, _) in enumerate(first))
        else:
            out[key] = statistics.median(m[key] for m in measured)
    return out
