"""The model's HBM bytes and FLOPs of a compiled engine step beside XLA's own count of the same program.

`compare(doc)` reads a sweep document (`aot.sweep`: TPU7x-8 compiles at the serving shape, each entry with XLA's
`cost_analysis()` FLOPs and bytes) and sets `step.step_costs` of the same work beside each entry, per stage and
step kind. How the two are made comparable:

- **Loops.** XLA's cost analysis counts a `while` body once. The decoder scans over its layer groups, so a
  full-depth compile reports one group's work plus what runs outside the scan; the comparison uses compiles of one
  layer group (`aot sweep --groups 1`, data/aot/tpu7x-8-g1.json), where the scan runs once, against the model of
  that one group (`num_layers` = one group). Loops inside a layer whose trip count depends on the data (the XLA
  attention's walk over a sequence's pages) are counted once by XLA too; the model's part that runs inside such a
  loop is set beside the compile per trip (`per_trip`), and the table says so.
- **Scan slices.** With one group the scan's per-group slices of the stacked weights are free views, so the model
  is taken without the sliced copies (`weight_passes` = 1) that a full-depth step pays.
- **Mosaic kernels.** XLA cannot see inside a Pallas (Mosaic) custom call: it counts the call's operands and
  results whole (every page of the KV pool, every expert). The kernels stage is therefore compared through its XLA
  twin, `hier_rs` (the same plan with the XLA kernels), and its own row says so.

What the comparison shows (`python -m qwen35_lib.costmodel validate --compiled`; the stored one-group decode
compiles, libtpu 0.0.42.1; tests/test_costmodel_compiled.py holds it):

| fused_ag decode, one group, per device | model | HLO text (`op_bytes`) | XLA `bytes accessed` |
|----------------------------------------|-------|-----------------------|----------------------|
| FLOPs (ragged_dot as XLA counts it)    | 732.7 G | -                   | 731.4 G              |
| HBM bytes, whole step                  | 21.4 GB | 77.1 GB             | 153.9 GB             |
| MoE (4 layers)                         | 17.0 GB | 40.3 GB + ~17 GB of unnamed dequantizing fusions | |
| GDN (3 layers)                         | 1.5 GB  | 6.6 GB + ~2.5 GB unnamed                       | |
| attention (1 layer)                    | 0.8 GB  | 2.0 GB + 3.6 GB of KV pool relayouts (unnamed)  | |
| LM head                                | 2.1 GB  | 2.1 GB                                          | |
| sampling                               | -       | 2.1 GB                                          | |

The mixed steps compiled so far (fused_ag, hier_rs and so kernels) read the same way: FLOPs x1.03 (the model's GDN
inverse counts whole [C, C] matrices), bytes x0.15 (43.8 GB against 297.8 GB; the text 178.2 GB). The TP baseline's
decode: FLOPs x0.89 (not yet explained), bytes x0.03 (XLA 675.7 GB, the text 81.5 GB).

- **FLOPs agree** once the grouped matmul is counted as XLA counts `ragged_dot`: every gathered row (N·k) against
  the device's experts, where the model counts the rows routed to them (N·k / EP). The rest of the step (the dense
  projections, the LM head) is the model's own count, within 0.2%.
- **Bytes do not** (issue 30 item 4 stays open): the XLA stages' compiled step moves 3.6x (the text) to 7x (XLA's
  count) what the model charges. What the model does not charge, read off the text:
  - the FP8 experts' dequantization as XLA:TPU compiles it: a float32 block scale broadcast over the weight, the
    dequantized bf16 weights relaid out on the SparseCore for `ragged_dot` (`sparse-core-data-format-call`), about
    18 bytes an expert element per layer against the model's 5 (1 FP8 read + a bf16 copy written and read);
  - the GDN state: the whole pool of every slot converted to float32 and back, and gathered sequence by sequence
    (a loop of 64 dynamic slices), against the model's one read and one write of each decoding sequence's state;
  - the KV pool relaid out between its stored (8, 128) tiles and the attention's (32, 128), both ways, every step;
  - sampling (sorts and gathers over the sampled rows' logits), which the model does not price.
  XLA's own count is twice the text's: a difference the text does not explain (XLA:TPU's per-fusion accounting).
- The kernels stage's Mosaic calls are opaque to both counts (a custom call counted with its operands whole), so
  its row is its XLA twin's.

The compile's shape: `ServingShape` (512 requests, 9,216-token pools, FP8 KV, 64 sequences a rank under DP8);
the model's batch is the compiled one (`compile_batch`): every decode row the step computes, bucket padding
included, each decode's context the pool's whole length (the compiled program does not know the lengths), the
prefill region in whole GDN chunks, and one logits row per sequence slot.
"""

from __future__ import annotations

from qwen35_lib.config import Config
from qwen35_lib.costmodel import ops
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.step import bind_to, step_costs
from qwen35_lib.plan import any_stage

TWIN = {"kernels": "hier_rs"}  # a stage whose kernels XLA cannot see into -> its XLA twin
DECODE_BYTES_TOLERANCE = 0.25  # issue 30, item 4: decode HBM bytes within 25% for every stage


def compile_batch(config: Config, ranks: int, requests: int, context_len: int, decode: int,
                  prefill: int = 0) -> ops.Batch:
    """The work `aot.compile_step(requests=, context_len=, decode=, prefill=)` compiles on `ranks` ranks, as one
    `ops.Batch` of the whole slice (see the module doc)."""
    C = config.gdn_chunk_size
    pre = -(-prefill // C) * C
    seqs = -(-requests // ranks)
    return ops.Batch(decodes=decode * ranks, decode_ctx=float(context_len), prefill_tokens=pre * ranks,
                     prefill_seqs=ranks if pre else 0, prefill_ctx=float(max(context_len - pre, 0)),
                     max_ctx=context_len, logit_rows=seqs * ranks)


# model components -> the blocks `parallel.hlo.op_bytes` names from the ops' jax names
BLOCK_OF = {"attn_proj": "attention", "attn_core": "attention", "gdn_proj": "gdn", "gdn_core": "gdn",
            "router": "moe", "shared_expert": "moe", "routed_experts": "moe", "permute": "moe",
            "onehot_permute": "moe", "moe_rows": "moe", "embed_lm_head": "lm_head", "norms": "other"}


def ragged_dot_flops(config: Config, plan, batch: ops.Batch) -> float:
    """FLOPs XLA's cost analysis counts for one device's grouped matmuls: `ragged_dot` with every gathered row
    against the expert weights, N·min(k, local experts) rows (`parallel.routing.local_experts`) of 2·3·D·F each
    per MoE layer, whether or not a row's expert is on this device."""
    local = config.num_experts // plan.ep if plan.moe == "ep" else config.num_experts
    f = config.moe_ffn // (1 if plan.moe == "ep" else plan.tp)
    rows = batch.computed * min(config.num_experts_per_tok, local) if plan.moe == "ep" else \
        batch.computed / plan.dp * config.num_experts_per_tok
    return config.num_layers * rows * 2 * 3 * config.hidden_size * f


def model_side(config: Config, stage: str, entry: dict, shape) -> dict:
    """The model's FLOPs and HBM bytes of one sweep entry's step, per device (see the module doc), by component
    and by `parallel.hlo.op_bytes` block."""
    sp = specs_lib.get("tpu7x-8")
    st = any_stage(stage)
    plan = bind_to(st, config, sp)
    batch = compile_batch(config, entry["ranks"], shape["requests"], shape["context_len"],
                          entry["decode_tokens_per_rank"], entry["prefill_tokens_per_rank"])
    costs = step_costs(config, sp, st, batch, shape["kv_dtype"], shape["page_size"], mech=Mechanisms.nominal(),
                       weight_passes=1)
    blocks = dict.fromkeys(("attention", "gdn", "moe", "lm_head", "other"), 0.0)
    for name, c in costs.items():
        blocks[BLOCK_OF[name]] += c.hbm_bytes
    flops = sum(c.flops for c in costs.values())
    dense = flops - costs["routed_experts"].flops + ragged_dot_flops(config, plan, batch)
    return dict(flops=flops, flops_as_xla_counts=dense, hbm_bytes=sum(c.hbm_bytes for c in costs.values()),
                bytes_by_block=blocks)


def compare(doc: dict) -> list[dict]:
    """One row per stage and step of a one-group sweep document: the compile's counts (XLA's `cost_analysis()`,
    and the HLO text's own by block) beside the model's, with their ratios; a stage with Mosaic kernels is read
    through its XLA twin (`TWIN`)."""
    from qwen35_lib.costmodel.predict import serving_model

    if doc.get("groups") != 1:
        raise ValueError(f"compare needs a one-group sweep (aot sweep --groups 1), got groups={doc.get('groups')}: "
                         "XLA counts the layer scan's body once, so a deeper compile reports one group of many")
    config = serving_model(doc["model"], **doc.get("overrides", {}))  # as `aot.sweep.serving_config` serves it
    config = config.replace(num_layers=len(config.layer_pattern))  # one layer group
    rows = []
    for stage, s in doc["stages"].items():
        for step, e in s["steps"].items():
            if step.startswith("1k/8k") or "flops" not in e or e.get("flops") is None:
                continue  # 1k/8k compiles the same programs as 8k/1k (aot.sweep)
            twin = TWIN.get(stage)
            judged = doc["stages"].get(twin, {}).get("steps", {}).get(step) if twin else e
            m = model_side(config, twin or stage, judged or e, doc["shape"]) if judged else None
            j = judged or e  # the twin's counts when the stage's own are opaque; its own are kept beside them
            row = dict(stage=stage, step=step.split()[-1], xla_flops=j["flops"], xla_bytes=j["bytes_accessed"],
                       text_bytes=sum((j.get("bytes_by_block") or {}).get("bytes", {}).values()) or None,
                       compared_with=twin or stage, own_xla_flops=e["flops"], own_xla_bytes=e["bytes_accessed"])
            if m and judged:
                row.update(model_flops=m["flops"], model_flops_as_xla_counts=m["flops_as_xla_counts"],
                           model_bytes=m["hbm_bytes"], model_bytes_by_block=m["bytes_by_block"],
                           text_bytes_by_block=(judged.get("bytes_by_block") or {}).get("bytes"),
                           loops_counted_once=(judged.get("bytes_by_block") or {}).get("loops_counted_once"),
                           flops_ratio=m["flops_as_xla_counts"] / judged["flops"],
                           bytes_ratio=m["hbm_bytes"] / judged["bytes_accessed"])
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The comparison as text: one line per stage and step."""
    out = [f"{'stage':<10} {'step':<7} {'XLA GFLOP':>10} {'model*':>8} {'ratio':>6}  {'XLA GB':>7} {'text GB':>8} "
           f"{'model GB':>9} {'ratio':>6}  compared with"]
    for r in rows:
        if "model_flops" not in r:
            out.append(f"{r['stage']:<10} {r['step']:<7} {r['xla_flops'] / 1e9:10.1f}   (no twin compiled)")
            continue
        text = f"{r['text_bytes'] / 1e9:8.1f}" if r.get("text_bytes") else f"{'-':>8}"
        out.append(f"{r['stage']:<10} {r['step']:<7} {r['xla_flops'] / 1e9:10.1f} "
                   f"{r['model_flops_as_xla_counts'] / 1e9:8.1f} {r['flops_ratio']:6.2f}  {r['xla_bytes'] / 1e9:7.1f} "
                   f"{text} {r['model_bytes'] / 1e9:9.1f} {r['bytes_ratio']:6.2f}  {r['compared_with']}")
    out.append("model*: the model's FLOPs with the grouped matmul counted as XLA counts ragged_dot (every gathered "
               "row); bytes: XLA's `bytes accessed`, the HLO text's own sum (parallel.hlo.op_bytes), the model's")
    return "\n".join(out)


__all__ = ["BLOCK_OF", "DECODE_BYTES_TOLERANCE", "TWIN", "compare", "compile_batch", "model_side",
           "ragged_dot_flops", "table"]
