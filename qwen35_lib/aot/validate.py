"""The cost model's validation (b): TPU7x ahead-of-time compiles against XLA's own counts.

`aot_forward(cfg, batch, seq)`: `forward` compiled for one TensorCore of `tpu7x:2x2x1` (`qwen35_lib.aot`); XLA's
`cost_analysis()` FLOPs and bytes and `memory_analysis()` argument bytes against the model's prediction for the
same work (a prefill of batch x seq tokens with every token's logits, XLA kernels). `aot_forward_isolated` runs it
in a child process. The other validations are `qwen35_lib.costmodel.validate`'s.
"""

from __future__ import annotations

import json
import time

from qwen35_lib.aot import compile_forward
from qwen35_lib.config import Config
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.ops import Batch
from qwen35_lib.costmodel.predict import weight_bytes_per_device
from qwen35_lib.costmodel.step import step_time
from qwen35_lib.costmodel.validate import SINGLE_XLA
from qwen35_lib.plan import SINGLE


def aot_forward(cfg: Config, batch: int, seq: int) -> dict:
    """XLA's own counts for `forward` compiled for tpu7x:2x2x1 (one TensorCore) vs the model's (see module doc)."""
    t = time.perf_counter()  # the XLA kernels, as the prediction (SINGLE_XLA) assumes
    xla = SINGLE.replace(attention_kernel="xla", gdn_kernel="xla", moe_kernel="ragged_dot", permute_kernel="xla")
    ex = compile_forward(cfg, batch, seq, plan=xla)
    seconds = time.perf_counter() - t
    ca = ex.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    ma = ex.memory_analysis()
    sp = specs_lib.get("tpu7x-8").replace(chips=1, devices_per_chip=1)
    b = Batch(prefill_tokens=batch * seq, prefill_seqs=batch, max_ctx=seq, logit_rows=batch * seq)
    pred = step_time(cfg, sp, SINGLE_XLA, b)
    weights = weight_bytes_per_device(cfg, sp, SINGLE_XLA)
    return dict(model=cfg.name, layers=cfg.num_layers, batch=batch, seq=seq, compile_s=seconds,
                xla_flops=float(ca.get("flops", 0.0)), predicted_flops=pred.flops,
                xla_bytes=float(ca.get("bytes accessed", 0.0)), predicted_bytes=pred.hbm_bytes,
                xla_argument_bytes=int(ma.argument_size_in_bytes), predicted_argument_bytes=weights,
                xla_temp_bytes=int(ma.temp_size_in_bytes),
                flops_ratio=pred.flops / float(ca.get("flops", 1.0)),
                bytes_ratio=pred.hbm_bytes / float(ca.get("bytes accessed", 1.0)),
                memory_ratio=weights / ma.argument_size_in_bytes)


def aot_forward_isolated(model: str, layers: int, batch: int, seq: int, timeout: float = 600) -> dict:
    """`aot_forward` of preset `model` with `layers` layers in a child process, so that a compiler crash is
    reported (`{"error": ...}`) instead of taking the caller down."""
    import os
    import subprocess
    import sys

    code = ("import json; from qwen35_lib import get_config; from qwen35_lib.aot import validate; "
            f"print(json.dumps(validate.aot_forward(get_config({model!r}, num_layers={layers}), {batch}, {seq})))")
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(model=model, layers=layers, batch=batch, seq=seq, error=f"compile took over {timeout} s")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        why = f"the compiler crashed (signal {-out.returncode})" if out.returncode < 0 else \
            (out.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return dict(model=model, layers=layers, batch=batch, seq=seq, error=why)
    return json.loads(lines[-1])


# single-op programs: (name, function, argument shapes), bf16 unless named
_PROBES = (
    ("elementwise", lambda x: x * 2, ((4096, 4096),)),
    ("reduce", lambda x: x.sum(0), ((4096, 4096),)),
    ("dot, 8 rows", lambda x, w: x @ w, ((8, 4096), (4096, 4096))),
    ("dot, 4096 rows", lambda x, w: x @ w, ((4096, 4096), (4096, 4096))),
    ("ragged_dot", None, ((5120, 4096), (64, 4096, 1024), "s32[64]")),
)


def xla_bytes_accessed_factors(topology: str | None = None) -> dict[str, dict]:
    """XLA:TPU's `cost_analysis()["bytes accessed"]` of single-op programs compiled for one TensorCore, against
    the bytes the op reads and writes (its arguments and result, each once): {probe: {"xla": bytes, "op": bytes,
    "factor": xla / op}}. On libtpu 0.0.42.1 an element-wise op and `ragged_dot` count x1.00, a reduction counts its
    input five times (x5.00), and a dot counts its right operand five times (x4.98 at 8 rows; 2.33 at 4096 rows,
    where x and the result weigh as much as w): why `costmodel.compiled` compares a model with the HLO text's own
    bytes (`parallel.hlo.op_bytes`), not with this count."""
    import jax
    import jax.numpy as jnp

    from qwen35_lib import aot

    device = aot.topology_devices(topology or aot.TPU7X_8)[0]
    one = jax.sharding.SingleDeviceSharding(device)
    out = {}
    for name, f, shapes in _PROBES:
        args = [jax.ShapeDtypeStruct((64,), jnp.int32, sharding=one) if s == "s32[64]" else
                jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=one) for s in shapes]
        f = f or (lambda x, w, g: jax.lax.ragged_dot(x, w, g))
        ca = jax.jit(f).lower(*args).compile().cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        op = sum(a.size * a.dtype.itemsize for a in args) + sum(
            o.size * o.dtype.itemsize for o in jax.tree.leaves(jax.eval_shape(f, *args)))
        out[name] = {"xla": float(ca["bytes accessed"]), "op": float(op), "factor": float(ca["bytes accessed"]) / op}
    return out
