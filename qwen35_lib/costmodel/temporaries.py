"""The engine step's temporaries on one device (what XLA:TPU holds besides the step's arguments and outputs), in
closed form from the serving plan, the config and the step's shape; never read from a compile
(tests/costmodel/test_temporaries.py compares it with the stored sweep's `temp_bytes`).

What the compiled TPU7x step keeps live (its buffer assignment, kernels stage, weights placed by `aot.mxu_format`):

| part          | what                                                                       | bytes              |
|---------------|----------------------------------------------------------------------------|--------------------|
| weight slices | the layer scan's slice of each stacked weight with more than one layer a   | sum of w / G       |
|               | group (GDN: 3 of 4; the router, shared expert, norms: 4 of 4), copied out  |                    |
|               | of the stack before the per-layer reads; one layer a group (attention) is  |                    |
|               | read in place; so are the projections under the Pallas `dense` kernel and  |                    |
|               | the FP8 experts under the Pallas MoE kernel; under the XLA MoE the experts |                    |
|               | are copied and dequantized (bf16: +2 bytes an element)                     | FP8 experts: 3·w/G |
| GDN state     | one layer's slice of the carried state: every slot's recurrent + conv state | state / L_gdn      |
| sampling      | the f32 logits of the sampled rows and the sort over them (values, s32 ids) | 3·S·V_l·4          |
| MoE rows      | one MoE layer's M = N_p·k routed rows (`routing.local_experts`): two bf16   | M·4D (+ M·2F XLA)  |
|               | [M, D] buffers live at once (the gathered rows, the grouped matmul's        | + N_p·D·4          |
|               | output); XLA's unfused FFN also holds its activations; the f32 sums of the |                    |
|               | N_p tokens                                                                 |                    |

(w: a stacked weight's bytes on the device, G layer groups, E_l local experts, D hidden, F expert FFN, S sequence
rows per rank, V_l the vocabulary on the device, N_p the step's gathered tokens padded to the EP size.)
The parts are live together (the slices are taken at the top of the loop body), so the estimate is their sum.
Checked against the stored sweep's steps that compiled with memory to spare (tests/costmodel/test_temporaries.py):
the kernels stage's mixed step (1,024 prefill tokens a rank) within 25% (397B, full depth: 1.79 GB against the
compile's 1.98 GB since its projections read the stacks in place and its routing gathers each row once; 4.72 GB
before, 5.83 GB while each layer's pools were sliced out of the stacked cache and written back). Its decode step
compiles 0.58 GB (was 1.13), of which the table's parts are 0.32 GB: the rest is not yet attributed (a strict
xfail). The XLA stages (dp_ep to hier_rs) compile with under 3 GB of a device's HBM to spare, so their `temp_bytes`
may be set by the memory limit rather than by the program (the compiler can trade memory for recomputation and
copies); they are not judged.

Reading a refusal. When a step does not fit, the TPU compiler refuses it with "the total memory required for HLO
temporaries (N G) exceeds available HBM (M G)". N is not the temporaries: it is the program's whole footprint,
its arguments included (G: GiB). A program of weights alone, with no temporaries to speak of, is refused with N
equal to its argument bytes (tests/costmodel/test_temporaries.py compiles one). `refused_bytes` reads N; the
temporaries of a refused step are N minus its arguments (`refused_temporaries`). The baseline's step at the
serving shape is refused this way (notebook 01 reads it).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from qwen35_lib.config import Config
from qwen35_lib.costmodel.traffic import StepShape, per_device, sizes
from qwen35_lib.engine.cache import CacheShape, declare_cache
from qwen35_lib.model.layer_loop import STACKED_DENSE
from qwen35_lib.parallel.shardings import spec
from qwen35_lib.plan import AXES, ServingPlan
from qwen35_lib.weights import declare, is_info

REFUSAL = re.compile(r"total memory required for HLO temporaries \(([\d.]+)G\)")  # the TPU compiler's OOM message
IN_PLACE_MOE = ("pallas",)  # MoE kernels that read the stacked expert weights in place (kernels/stacked.py)
IN_PLACE_DENSE = ("pallas",)  # dense kernels that read the stacked projections in place (kernels/dense/pallas.py)


def _ways(plan: ServingPlan, info) -> int:
    _, chips, cores = sizes(plan)
    split = spec(plan, AbstractMesh((chips, cores), AXES), info.logical_axes, info.shape)
    return math.prod(dict(plan.mesh_shape)[a] for e in split if e is not None
                     for a in ((e,) if isinstance(e, str) else e))


def weight_slices(plan: ServingPlan, config: Config) -> float:
    """Bytes of the group slices the layer loop copies out of the stacked weights (the table's first row)."""
    cfg = plan.placed(config)
    G = cfg.num_groups
    in_place = plan.kernel("moe_matmul") in IN_PLACE_MOE
    dense = STACKED_DENSE if plan.kernel("dense") in IN_PLACE_DENSE else {}  # projections read from the stacks
    total = 0.0
    flat, _ = jax.tree_util.tree_flatten_with_path(declare(cfg)["layers"], is_leaf=is_info)
    for path, info in flat:
        keys = [getattr(p, "key", getattr(p, "name", "")) for p in path]
        if info.shape[1] <= 1:  # [G, layers of this kind in a group, ...]: one a group, read in place
            continue
        if keys[-1] in dense.get(keys[0], ()):
            continue
        nbytes = info.nbytes / _ways(plan, info) / G
        if keys[0] == "moe" and keys[1] in ("w_gate_up", "w_down"):
            if in_place:
                continue
            if jnp.dtype(info.dtype).itemsize < 2:  # FP8 values: copied, then dequantized to bf16 (+2 bytes each)
                nbytes *= 1 + 2 / jnp.dtype(info.dtype).itemsize
        total += nbytes
    return total


def gdn_state_slice(plan: ServingPlan, config: Config, cache: CacheShape) -> float:
    """Bytes of one GDN layer's slice of the carried state (every slot's recurrent and conv state)."""
    cfg = plan.placed(config)
    caches = declare_cache(cfg, cache)
    held = per_device(plan, caches)
    # [G, GDN layers in a group, ...] each: one layer's share
    return sum(v / math.prod(caches[k].shape[:2]) for k, v in held.items() if k not in ("kv", "kv_scale"))


def sampling(plan: ServingPlan, config: Config, shape: StepShape) -> float:
    """Bytes of the sampled rows' f32 logits and of the sort over them (values and s32 indices)."""
    cfg = plan.placed(config)
    head = declare(cfg)["lm_head"]
    return 3 * shape.seqs * cfg.vocab_size / _ways(plan, head) * 4


def moe_rows(plan: ServingPlan, config: Config, shape: StepShape) -> float:
    """Bytes of one MoE layer's row buffers (the table's last row): two [M, D] bf16 buffers of the M = N_p·k routed
    rows live at once (the rows gathered in expert order and the grouped matmul's output, which the combine reads),
    and the f32 sums of the N_p tokens; an MoE kernel that does not fuse its FFN (XLA's) also holds the
    activations."""
    n, _, _ = sizes(plan)
    cfg = config
    N = plan.dp * shape.tokens
    Np = N + (-N % n) if plan.moe == "ep" else N
    M = Np * cfg.num_experts_per_tok
    D, F = cfg.hidden_size, cfg.moe_ffn
    if plan.moe != "ep":
        F = F // n  # TP: the expert FFN split over the devices
    fused = plan.kernel("moe_matmul") in IN_PLACE_MOE  # the Pallas kernel keeps [rows, F] in VMEM
    return M * (2 * D + 2 * D + (0 if fused else 2 * F)) + Np * D * 4


def step_temporaries(plan: ServingPlan, config: Config, shape: StepShape, cache: CacheShape) -> dict[str, float]:
    """{part: bytes} of the table and "total", per device, for one engine step of `shape` with caches `cache` under
    the bound `plan` (`config` as the stage applies it: its MoE kernel decides whether experts are copied)."""
    parts = {"weight_slices": weight_slices(plan, config), "gdn_state": gdn_state_slice(plan, config, cache),
             "sampling": sampling(plan, config, shape), "moe_rows": moe_rows(plan, config, shape)}
    return dict(parts, total=sum(parts.values()))


def refused_bytes(error: str) -> float | None:
    """The bytes per device a TPU compile refused for lack of HBM says the program needs, or None (no such refusal).

    The message's "HLO temporaries (N G)" counts the program's arguments too: N GiB is its whole footprint."""
    match = REFUSAL.search(error or "")
    return float(match.group(1)) * 2**30 if match else None


def refused_temporaries(error: str, argument_bytes: float) -> float | None:
    """The temporaries of a refused step: the refusal's whole footprint (`refused_bytes`) minus the step's
    arguments (weights and caches, `argument_bytes`), to the message's 0.01 GiB; None when `error` is no such
    refusal."""
    total = refused_bytes(error)
    return None if total is None else total - argument_bytes


__all__ = ["IN_PLACE_MOE", "REFUSAL", "gdn_state_slice", "moe_rows", "refused_bytes", "refused_temporaries", "sampling",
           "step_temporaries", "weight_slices"]
