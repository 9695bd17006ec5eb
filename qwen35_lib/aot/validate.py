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
