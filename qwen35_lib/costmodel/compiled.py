"""The model's HBM bytes and FLOPs of a compiled engine step beside the compile's own count of the same program.

`compare(doc)` reads the ahead-of-time sweep (`aot.sweep`: every ladder stage's engine steps compiled for TPU7x-8
at the serving shape, full depth) and sets `step.step_costs` of the same work beside each decode step, per stage.
How the compile is read:

- **Bytes: the HLO text, not `cost_analysis()`.** `parallel.hlo.op_rows` reads the optimized HLO text the sweep
  keeps (data/aot/hlo/): every top-level op reads its operands and writes its result, times the runs of its loop
  (the layer scan's 15 trips; the XLA attention's walk over a sequence's pages, whose trip count depends on the
  data, its whole pool's pages, as every sequence of the compiled step sits at the pool's full length), counting
  HBM only: an array XLA:TPU placed in VMEM (a layout with S(1)) moves none, so a prefetch into VMEM is one read.
  XLA:TPU's `bytes accessed` is no measure of HBM traffic: it counts a `while` body once, and a reduction's input
  and a dot's right operand five times (`aot.validate.xla_bytes_accessed_factors`, held by
  tests/integration/test_tpu_compile.py).
- **FLOPs: `cost_analysis()`, one layer group.** XLA counts the layer scan's body once, so its FLOPs are one
  group's plus what runs outside the scan; the model's are taken for one group (`num_layers` = one group), with the
  grouped matmul counted as XLA counts `ragged_dot` (`ragged_dot_flops`).
- **Mosaic kernels** (the kernels stage) are custom calls: the text counts their operands whole (every page of the
  pool, every local expert). At decode with every sequence at the pool's full length and nearly every expert hit,
  that is what they read. The permute's combine is compared with them (the model's `permute` prices it).
- **Collectives**: the model prices their time on the links (`step`); their buffers, read and written in HBM
  (`collective_hbm_bytes`), are the model's bytes here.

What the comparison shows (`python -m qwen35_lib.costmodel validate --compiled`; libtpu 0.0.42.1, the serving shape:
512 requests, 9,216-token FP8 KV pools, 64 sequences a rank under DP8; tests/costmodel/test_compiled.py holds it):

| decode step, per device | XLA GFLOP | model | HLO text GB | model GB | bytes ratio |
|-------------------------|-----------|-------|-------------|----------|-------------|
| dp_ep, replicate, fused_ag, hier_rs | 731.3 | 713.4 | 1,191-1,194 | 1,116 | 0.93-0.94 |
| kernels (around its Mosaic calls, its projections among them) | 738.5 | 732.7 | 17.9 | 18.8 | 1.05 |
| baseline (at its largest pool, 7,168 tokens) | 328.2 | 271.6 (x0.83, unexplained) | 808 | 766 | 0.95 |
| mixed (1,024 prefill tokens a rank), XLA DP | 10,063-10,064 | 10,077 | 2,408-2,457 | 1,445-1,452 | 0.59-0.60 (+) |
| mixed step, kernels (around its Mosaic calls) | 10,410.3 | 10,388.0 | 208.2 | 208.3 | 1.00 (++) |

(+) what the XLA stages' mixed step moves around the prefill rows is not priced: the XLA GDN's and attention's glue,
the MoE's float32 copies of the routed rows (`f32[87040, 1, 1024]`, 0.17 TB a step) and its larger dequantizing
traffic, and a relayout of the FP8 scale pool once a layer (4 GB).
(++) the glue XLA compiles around the Pallas kernels is priced as this engine's (`ops.glue`), by passes measured on
this very text (`glue_passes`: 49.8 GB of the 208.2), so this row agrees by construction; what checks the pricing is
the other steps it prices from those passes: this stage's decode (x1.05: 64 tokens a rank keep more of the glue's
arrays in VMEM, the attention's most) and the fused_ep stage's decode and mixed steps (data/aot/tpu7x-8-beyond.json,
x1.05 and x0.99, another compile with the same GDN, attention and residual-stream code, no hierarchical
reduce-scatter, and its all-gathered tokens relaid out twice a layer, `fused_combine.GATHERED_RELAYOUTS`, a count read
off its own mixed text); the residual stream's passes are nearly the same at decode (15.7) as in the mixed step
(15.8), the attention's are not (1.8 against 9.6: at decode its arrays stay in VMEM). The permute is priced
from the structure: the fact's 3 passes and, in the mixed step, the combine's bf16 sums [8704, 4096] written (too
large for the scoped VMEM, `moe_costs.SCOPED_VMEM_BYTES`), 132.6 GB against the text's 132.9 (the combine wrote float32
sums there for XLA to read and cast before: 150.0 GB, 229.0 around the Mosaic calls)

The baseline's mixed step does not fit at the serving shape and is not compared; the tests hold the decode steps.
The XLA attention's walk over the pages has a trip count the text does not state: its bytes are the trip's times the
pool's pages of a sequence (`text_side`), and XLA's FLOPs count it once, as the model's FLOPs here do.

The bytes agree because the model charges what the compiled program moves where it moves more than the arithmetic
(data/costmodel_hardware.json 'kernels', each fact with the ops it sums, read off these texts):
- the engine's caches are updated in place (`engine_cache_copy_passes` = 0: each layer's pages and slots are rows of
  one pool a kind, `model.ragged`, the XLA attention's FP8 pool stored as uint32 words; the sweep records which
  pools a step's layer loop copies, `cache_pools_copied`: none of the KV pages or GDN state in any stage);
- XLA:TPU's FP8 experts move 20.3 B a parameter under EP (`xla_tpu_fp8_expert_bytes`: sliced copies and
  relayouts, a float32 scale broadcast, the dequantizing fusions, bf16 relayouts; `fp8_expert_bytes`) and 12.4 under
  TP (`xla_tpu_fp8_expert_bytes_tp`, the TP baseline's text: every expert's 1/8 slice), its paged attention 3.3 B a
  KV value a decode token's walk reads and 8.0 B one an item's walk reads (`xla_tpu_paged_attention_bytes`,
  `xla_tpu_items_attention_bytes`: the page read, unpacked from the pool's uint32 words and scaled, a group of
  WALK_ROWS rows' gathered pages and scores in VMEM; `paged_attention_bytes`), its GDN decode 4 passes over a state
  (`xla_tpu_gdn_state_passes`: gathered and scattered; `gdn_state_passes`), each read off dp_ep's texts but the TP
  experts';
- the dense projections are sliced scan inputs under XLA's dots (`xla_weight_passes`: 4.12, dp_ep's decode, some
  slices rematerialized: `scan_weight_passes`) and read in place by the Pallas projection (`pallas_dense_weight_passes`:
  1.00, the kernels decode's), beside which the router is still XLA's dot on its slice (`pallas_router_passes`: 3);
  the kernels stage's MoE layer moves the routed rows 3 times (`kernels_moe_permute_passes`, `permute_passes`: its
  gather 2, its combine 1; production: 2);
- what every engine's step moves besides: the sampler's sort over the vocabulary (`sampling_logit_passes`: 38.5
  passes over a sampled sequence's float32 logits, its costlier branch) and the conv's rows (`ops.conv`); and this
  engine's grouped matmul takes its FP8 block scales repeated along lanes, expanded by XLA each layer
  (`expert_scales`);
- this engine's XLA glue around its Pallas kernels (`ops.glue`: `pallas_gdn_glue_passes`,
  `pallas_attention_glue_passes`, `pallas_stream_glue_passes`, `pallas_hier_rs_glue_passes` (the hierarchical
  reduce-scatter's micro-batch slices, where the plan has it), read off the kernels stage's mixed text by
  `glue_passes`, its ops sorted by `step_parts`).
What remains: the XLA stages' texts hold 6% more than the model at decode (by block: `validate --compiled`); the
kernels stage's decode 6% less (the glue's passes are the mixed step's, (++)); the XLA stages' mixed steps' model is
0.59-0.60 of their texts ((+)); the baseline's text 6% more than its model. The TP
baseline's FLOPs are x0.83 of XLA's, not yet explained.

The model's batch is the compiled one (`compile_batch`): every decode row the step computes, bucket padding
included, each decode's context the pool's whole length (the compiled program does not know the lengths), the
prefill region in whole GDN chunks, and one logits row per sequence slot.
"""

from __future__ import annotations

import math
import re

from qwen35_lib.config import Config
from qwen35_lib.costmodel import ops, traffic
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms
from qwen35_lib.costmodel.step import Pools, bind_to, pricing, step_costs
from qwen35_lib.parallel import hlo
from qwen35_lib.parallel.routing import PERMUTE_SCOPE
from qwen35_lib.plan import any_stage

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
            "cache_copies": "other",
            "router": "moe", "shared_expert": "moe", "routed_experts": "moe", "permute": "moe",
            "onehot_permute": "moe", "moe_rows": "moe", "embed_lm_head": "lm_head", "norms": "other",
            "sampling": "sample", "gdn_conv": "gdn", "expert_scales": "moe", "glue": "other"}


def ragged_dot_flops(config: Config, plan, batch: ops.Batch) -> float:
    """FLOPs XLA's cost analysis counts for one device's grouped matmuls: `ragged_dot` with every gathered row
    against the expert weights, N·min(k, local experts) rows (`parallel.routing.local_experts`) of 2·3·D·F each
    per MoE layer, whether or not a row's expert is on this device."""
    local = config.num_experts // plan.ep if plan.moe == "ep" else config.num_experts
    f = config.moe_ffn // (1 if plan.moe == "ep" else plan.tp)
    rows = batch.computed * min(config.num_experts_per_tok, local) if plan.moe == "ep" else \
        batch.computed / plan.dp * config.num_experts_per_tok
    return config.num_layers * rows * 2 * 3 * config.hidden_size * f


def model_side(config: Config, stage: str, entry: dict, shape: dict) -> dict:
    """The model's FLOPs (of one layer group, as XLA counts them) and HBM bytes (of the whole step, the engine's
    cache pools those of the compile) of one sweep entry's step, per device, by component and by
    `parallel.hlo.op_bytes` block; `config` at full depth."""
    sp = specs_lib.get("tpu7x-8")
    st = any_stage(stage)
    plan = bind_to(st, config, sp)
    context = entry.get("context_len", shape["context_len"])
    batch = compile_batch(config, entry["ranks"], shape["requests"], context, entry["decode_tokens_per_rank"],
                          entry["prefill_tokens_per_rank"])
    z = ops.sizes(config)
    pools = Pools(kv=entry["kv_bytes"] / max(z["n_attn"], 1), gdn=entry["gdn_state_bytes"] / max(z["n_gdn"], 1))
    costs = step_costs(config, sp, st, batch, shape["kv_dtype"], shape["page_size"], mech=Mechanisms.nominal(),
                       pools=pools)
    blocks = dict.fromkeys(("attention", "gdn", "moe", "lm_head", "sample", "other"), 0.0)
    for name, c in costs.items():
        blocks[BLOCK_OF[name]] += c.hbm_bytes
    shape_ = traffic.StepShape.of_compile(config, entry["ranks"], shape["requests"], entry["decode_tokens_per_rank"],
                                          entry["prefill_tokens_per_rank"])
    blocks["collectives"] = collective_hbm_bytes(traffic.step_collectives(plan, config, shape_))
    group = config.replace(num_layers=len(config.layer_pattern))  # XLA counts the scan's body once
    gcosts = step_costs(group, sp, st, batch, shape["kv_dtype"], shape["page_size"], mech=Mechanisms.nominal())
    flops = sum(c.flops for c in gcosts.values())
    # a Pallas kernel states its FLOPs to XLA (`pl.CostEstimate`): the grouped matmul's as XLA counts ragged_dot's
    dense = flops - gcosts["routed_experts"].flops + ragged_dot_flops(group, plan, batch)
    if plan.kernel("attention") != "pallas":  # XLA counts the XLA attention's walk once: one trip of one group
        walk = ops.xla_walk(batch, pricing(group, sp, st, shape["kv_dtype"], shape["page_size"]))
        dense -= gcosts["attn_core"].flops * (1 - 1 / (walk.groups * walk.trips))
    by_component = {k: c.hbm_bytes for k, c in costs.items()} | {"collectives": blocks["collectives"]}
    return dict(flops=flops, flops_as_xla_counts=dense, hbm_bytes=sum(by_component.values()), bytes_by_block=blocks,
                bytes_by_component=by_component)


def collective_hbm_bytes(collectives: list[traffic.Op]) -> float:
    """The HBM bytes the collectives' buffers move on one device (their time is the links', `step`): each reads its
    operand and writes its result, an all-gather's operand 1/group of its result, a reduce-scatter's result 1/group
    of its operand."""
    whole = lambda op: op.bytes + op.bytes / op.group if op.kind in ("all-gather", "reduce-scatter") else 2 * op.bytes
    return sum(op.runs * whole(op) for op in collectives)


def text_side(text: str, context_len: int, page_size: int) -> dict:
    """The compile's HBM bytes by `parallel.hlo.op_rows`: the XLA attention's page loop (the only loop whose trip
    count the text does not state) times the pool's pages of a sequence; Mosaic calls (custom calls of Pallas
    kernels) apart, since the text counts their operands whole, but for the permute's combine, whose rows it reads
    and writes whole (the model's `permute` prices it). {"bytes", "bytes_by_block", "mosaic_bytes",
    "loops": {body: trips}}."""
    bodies = hlo.op_rows(text)[1]
    trips = {b: -(-context_len // page_size) for b in bodies}
    rows, once = hlo.op_rows(text, trips)
    if once:
        raise ValueError(f"loops of unknown trip count besides the attention's: {once}")
    blocks = dict.fromkeys(hlo.BLOCKS, 0)
    mosaic = 0
    for r in rows:  # the permute's Mosaic combine stays: the model's `permute` prices it (`permute_passes`)
        if r.op == "custom-call" and "pallas_call" in r.jax_name and f"/{PERMUTE_SCOPE}/" not in r.jax_name:
            mosaic += r.bytes
        else:
            blocks[r.block] += r.bytes
    return dict(bytes=sum(blocks.values()), bytes_by_block=blocks, mosaic_bytes=mosaic, loops=trips)


def compare(doc: dict, texts: dict[tuple[str, str], str] | None = None) -> list[dict]:
    """One row per stage's decode step of a full-depth sweep document (`aot.sweep`): XLA's FLOPs beside the
    model's for one layer group; the HLO text's bytes (`texts[(stage, step)]`, default data/aot/hlo/ through
    `aot.sweep.hlo_path`'s names) beside the model's whole step. A stage with Mosaic kernels compares what XLA
    compiles around them: its text without the Mosaic calls beside the model without the kernels' components
    (`MOSAIC_COMPONENTS`)."""
    from qwen35_lib.costmodel.predict import serving_model

    if doc.get("groups", 0) < 2:
        raise ValueError(f"compare needs a full-depth sweep, got groups={doc.get('groups')}: with one group XLA "
                         "drops the one-trip layer loop and fuses across layers (aot sweep without --groups)")
    config = serving_model(doc["model"], **doc.get("overrides", {}))  # as `aot.sweep.serving_config` serves it
    config = config.replace(num_layers=doc["groups"] * len(config.layer_pattern))
    rows = []
    for stage, s in doc["stages"].items():
        steps = {k: e for k, e in s["steps"].items() if k in ("8k/1k decode", "8k/1k mixed")}  # 1k/8k: the same
        # programs
        if not steps.get("8k/1k decode", {}).get("fits") and "decode" in s.get("largest_pool", {}):
            steps = {"pool decode": s["largest_pool"]["decode"]}  # a decode refused at the serving shape: the
            # one compiled at the largest pool that fits (`aot.sweep.largest_pool`)
        for step, e in steps.items():
            if e.get("flops") is None:
                continue
            text = (texts or {}).get((stage, step)) or stored_text(stage, step)
            if text is None:
                continue
            context = e.get("context_len", doc["shape"]["context_len"])
            t = text_side(text, context, doc["shape"]["page_size"])
            m = model_side(config, stage, e, doc["shape"])
            plan = bind_to(any_stage(stage), config, specs_lib.get("tpu7x-8"))
            mosaic = {c for slot, cs in MOSAIC_COMPONENTS.items() if plan.kernel(slot) == "pallas" for c in cs} \
                if t["mosaic_bytes"] else set()
            model_bytes = m["hbm_bytes"] - sum(m["bytes_by_component"].get(c, 0.0) for c in mosaic)
            rows.append(dict(stage=stage, step=step.split()[-1], context_len=context, xla_flops=e["flops"],
                             model_flops=m["flops"], model_flops_as_xla_counts=m["flops_as_xla_counts"],
                             flops_ratio=m["flops_as_xla_counts"] / e["flops"], text_bytes=t["bytes"],
                             text_bytes_by_block=t["bytes_by_block"], mosaic_bytes=t["mosaic_bytes"],
                             model_bytes=model_bytes, model_bytes_by_block=m["bytes_by_block"],
                             model_bytes_by_component=m["bytes_by_component"], without=sorted(mosaic),
                             bytes_ratio=model_bytes / t["bytes"], xla_bytes_accessed=e["bytes_accessed"]))
    return rows


# the model's components a Pallas stage runs as Mosaic calls, by the kernel slot that runs them (the ragged paged
# attention, the GDN kernels, the grouped matmul, the dense projections; the permute's dispatch is XLA's gather, its
# combine a Mosaic call that the model's `permute` keeps): compared with the compile without those calls
MOSAIC_COMPONENTS = {"attention": ("attn_core",), "gdn": ("gdn_core",), "moe_matmul": ("routed_experts",),
                     "dense": ("gdn_proj", "attn_proj", "shared_expert")}


def stored_text(stage: str, step: str) -> str | None:
    """The optimized HLO text the sweep stored for `stage`'s `step` (data/aot/hlo/), None where it kept none."""
    import gzip

    from qwen35_lib import data

    name = f"{stage}-{step.replace('/', '_').replace(' ', '-')}.hlo.gz"  # aot.sweep.hlo_path's
    p = data.path(f"aot/hlo/{name}")
    return gzip.decompress(p.read_bytes()).decode() if p.is_file() else None


def table(rows: list[dict]) -> str:
    """The comparison as text: one line per stage."""
    out = [f"{'stage':<10} {'step':<7} {'XLA GFLOP':>10} {'model*':>8} {'ratio':>6}  {'text GB':>8} {'model GB':>9} "
           f"{'ratio':>6}  {'Mosaic GB':>9}"]
    for r in rows:
        out.append(f"{r['stage']:<10} {r['step']:<7} {r['xla_flops'] / 1e9:10.1f} "
                   f"{r['model_flops_as_xla_counts'] / 1e9:8.1f} {r['flops_ratio']:6.2f}  {r['text_bytes'] / 1e9:8.1f} "
                   f"{r['model_bytes'] / 1e9:9.1f} {r['bytes_ratio']:6.2f}  {r['mosaic_bytes'] / 1e9:9.1f}")
    out.append("model*: the model's FLOPs of one layer group with the grouped matmul counted as XLA counts ragged_dot "
               "(every gathered row), against XLA's (the scan's body once); bytes: the whole step's, the HLO text's "
               "own (parallel.hlo.op_rows) against the model's, a Pallas stage's without its Mosaic calls and the "
               "components they run")
    return "\n".join(out)


__all__ = ["BLOCK_OF", "DECODE_BYTES_TOLERANCE", "GLUE_PARTS", "MOSAIC_COMPONENTS", "compare", "compile_batch",
           "glue_passes", "model_side", "ragged_dot_flops", "step_parts", "table", "text_side"]


SCAN_SLICES = ("dynamic_index_in_dim", "/dynamic_slice")  # the jax names of the layer scan's weight slices


def scan_weight_passes(hlo_text: str, config: Config, stage: str) -> float:
    """HBM passes over each dense weight byte (attention and GDN projections, router, shared expert: every layer
    weight but the routed experts) that the compiled engine step's layer scan makes, from its HLO text: the dots'
    one read, plus what the scan's slices of the stacked bf16 weights move (`parallel.hlo.op_rows` of the bf16
    ops named `dynamic_index_in_dim` / `dynamic_slice` outside a model block: each group's slice read, written, and
    read again where XLA rematerializes it; the FP8 experts' slices, which the XLA stages also take, are not
    dense weights) over the dense weight bytes one device holds (`config` at full depth). A `dense` kernel that
    reads the stacks in place (`kernels.dense.pallas`) leaves only the small per-layer vectors sliced: about 1; the
    router, still XLA's dot on its slice there, is measured apart (`router_passes`)."""
    sp = specs_lib.get("tpu7x-8")
    plan = bind_to(any_stage(stage), config, sp)
    apart = plan.kernel("dense") == "pallas"
    z = ops.sizes(config)
    sliced = sum(r.bytes for r in _scan_slices(hlo_text) if not (apart and _router_slice(r.shape, config)))
    mixers = z["attn"] * z["n_attn"] + z["gdn"] * z["n_gdn"]
    router = 0 if apart else z["router"]
    dense = (mixers / plan.tp + (router + z["shared"] / (1 if plan.moe == "ep" else plan.tp))
             * config.num_layers) * z["act"]
    return 1 + sliced / dense


def router_passes(hlo_text: str, config: Config) -> float:
    """`scan_weight_passes` of the router alone (its [D, E] slices of the scan), for a stage whose `dense` kernel
    reads the other projections in place while the router is XLA's dot on the scan's slice."""
    z = ops.sizes(config)
    sliced = sum(r.bytes for r in _scan_slices(hlo_text) if _router_slice(r.shape, config))
    return 1 + sliced / (z["router"] * config.num_layers * z["act"])


def _scan_slices(hlo_text: str) -> list:
    """The ops of the layer scan's bf16 weight slices (`SCAN_SLICES`, outside a model block)."""
    return [r for r in hlo.op_rows(hlo_text)[0] if r.block == "other" and any(s in r.jax_name for s in SCAN_SLICES)
            and r.shape.lstrip("(").startswith("bf16")]


def _router_slice(shape: str, config: Config) -> bool:
    """Whether `shape` is of the stacked router's [..., D, E]."""
    return f"{config.hidden_size},{config.num_experts}]" in shape


def permute_passes(hlo_text: str, config: Config, tokens: int) -> float:
    """HBM passes over the routed rows [tokens·k, D] (activation dtype) that the compiled MoE layers' dispatch and
    combine make, from the HLO text: the bytes of every op in `parallel.routing.PERMUTE_SCOPE` (the gather of the
    rows into expert order, the weighted un-sort with its float32 output, the cast back; Pallas calls included,
    their operands and results), plus the relayouts XLA inserts on arrays of exactly the routed rows' size (copies
    and SparseCore data-format calls: they carry no jax name), over num_layers x tokens·k x D x act. `tokens`: the
    tokens each device routes (replicate routing: the whole step's, all-gathered)."""
    rows, _ = hlo.op_rows(hlo_text)
    z = ops.sizes(config)
    size = tokens * config.num_experts_per_tok * config.hidden_size
    act = {2: "bf16", 4: "f32"}[int(z["act"])]

    def routed(shape: str) -> bool:  # an array of the routed rows' size in the activation dtype
        return any(t == act and math.prod(int(n) for n in dims.split(",") if n) == size
                   for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape))

    moved = sum(r.bytes for r in rows if f"/{PERMUTE_SCOPE}/" in f"{r.jax_name}/"
                or (not r.jax_name and r.op in RELAYOUT_OPS and routed(r.shape)))
    return moved / (config.num_layers * size * z["act"])


RELAYOUT_OPS = ("copy", "copy-start", "copy-done", "call-start", "call-done")  # ops XLA inserts to relay arrays out


def sampling_passes(hlo_text: str, config: Config, rows: int) -> float:
    """HBM passes over the float32 logits [rows, V] that the compiled step's sampler makes, from its HLO text: the ops
    of the step's one conditional (`engine.sampling.sample`: the argmax when every row is greedy, else the sort over
    the vocabulary with its top-k / top-p / min-p masks and the draw; `parallel.hlo.op_rows` counts the costlier
    branch, as a batch with a sampled row runs it). `rows`: the sequences one device samples."""
    branches = [line for lines in hlo.computations(hlo_text).values() for line in lines if " conditional(" in line]
    if len(branches) != 1:
        raise ValueError(f"the step should hold one conditional (the sampler), found {len(branches)}")
    inside = set().union(*(hlo.called(hlo_text, b.strip().lstrip("%"))
                           for b in re.search(r"branch_computations=\{([^}]*)\}", branches[0])[1].split(", ")))
    rows_, _ = hlo.op_rows(hlo_text)
    return sum(r.bytes for r in rows_ if r.computation in inside) / (rows * config.vocab_size * 4)


def paged_attention_bytes(hlo_text: str, config: Config, rows: int, kv_width: int, page_size: int) -> float:
    """HBM bytes the compiled XLA attention moves per KV value it reads, from the HLO text: the ops of its walk over
    the pages (the loops whose trip count the text does not state, `parallel.hlo.op_rows`' `once`; one trip: each
    of `rows` rows gathers one page, a decode token's in the twin, an item's in `paged_attention_items`) over the
    values one trip reads in every attention layer (n_attn x rows x page_size x `kv_width`, the token row's
    values on one device). 1 plus the scales' share would be the page read alone."""
    rows_, once = hlo.op_rows(hlo_text)
    inside = set().union(set(), *(hlo.called(hlo_text, b) for b in once))
    moved = sum(r.bytes for r in rows_ if r.computation in inside and r.block == "attention")
    n_attn = ops.sizes(config)["n_attn"]
    return moved / (n_attn * rows * page_size * kv_width)


def fp8_expert_bytes(hlo_text: str, config: Config, local_experts: int) -> float:
    """HBM bytes the compiled XLA MoE moves per FP8 expert parameter and layer, from the HLO text: every op whose
    result holds an array of a whole number (>= 1) of the local experts' [E_local, D, F] (the scan's slices and
    their relayouts, the block scales broadcast to the weights' size, the dequantizing fusions, bf16 relayouts),
    plus the grouped matmul's read of its bf16 operand whole (2 B a parameter: ragged_dot reads every local
    expert), over num_layers x 3 x E_local x D x F."""
    size = local_experts * config.hidden_size * config.moe_ffn

    def weights(shape: str) -> bool:
        return any((n := math.prod(int(d) for d in dims.split(",") if d)) >= size and n % size == 0
                   for _, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape))

    moved = sum(r.bytes for r in hlo.op_rows(hlo_text)[0] if weights(r.shape))
    return moved / (config.num_layers * 3 * size) + 2


def gdn_state_passes(hlo_text: str, config: Config, sequences: int) -> float:
    """HBM passes over each decoding sequence's GDN state that the compiled XLA GDN layers make, from the HLO text:
    the ops of the GDN block whose result holds the states of at least `sequences` sequences ([n, Hv, dk, dv] on
    one device: the gather of the sequences' states, the recurrent step's read and write, the scatter back) over
    n_gdn x `sequences` states."""
    c = config
    tail = f"{c.gdn_k_head_dim},{c.gdn_v_head_dim}]"
    moved, state = 0, 0
    for r in hlo.op_rows(hlo_text)[0]:
        if r.block != "gdn":
            continue
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", r.shape):
            d = [int(x) for x in dims.split(",") if x]
            if f"{dims}]".endswith(tail) and len(d) >= 4 and d[-4] >= sequences:
                moved += r.bytes
                state = d[-3] * d[-2] * d[-1] * hlo.BYTES[dt]
                break
    return moved / (ops.sizes(c)["n_gdn"] * sequences * state) if state else 0.0


# the parts of a Pallas stage's step that XLA compiles around its Mosaic calls and the model prices as glue
# (`ops.glue`): the GDN's and the attention's ops, the residual stream's (copies and prefetches of the rows between
# the kernels, the reduce-scatters' results put back), and the hierarchical reduce-scatter's micro-batches sliced out
# of the combine's rows ([core, chip, micro-batch, rows, D] views, `parallel.collectives.reduce_scatter`)
GLUE_PARTS = ("gdn", "attention", "stream", "hier_rs")


def step_parts(hlo_text: str) -> dict[str, list]:
    """The ops of a compiled step besides its Mosaic calls (`parallel.hlo.op_rows`, loops at their trip counts), by
    what the model prices them as: "permute" (`parallel.routing.PERMUTE_SCOPE`), "collectives" (the all-gathers'
    and reduce-scatters' own ops), "scan_slices" (the layer scan's weight slices: the weight passes), "moe_priced"
    (the router's dot, the FP8 scales' float32 expansion), "gdn", "attention", "stream" (`GLUE_PARTS`), "head"
    (embedding, LM head, sampler). An op XLA left unnamed (a relayout copy, a SparseCore data-format call, a
    prefetch into VMEM, a collective's second stage) takes the part of the nearest named op it reads; "hier_rs" holds
    the hierarchical reduce-scatter's slices of the combine's rows into micro-batches (`GLUE_PARTS`)."""
    rows, once = hlo.op_rows(hlo_text)
    if once:  # a Pallas stage's step has none (its attention is a kernel)
        raise ValueError(f"loops of unknown trip count: {once}; step_parts reads a Pallas stage's step")
    named, operands = {}, {}
    for line in hlo_text.splitlines():
        m = hlo.INSTR.match(line)
        if m:
            j = hlo.OP_NAME.search(line)
            named[m[2]] = (hlo.block(line), j[1], m[2]) if j else None
            operands[m[2]] = hlo.VAR.findall(m[5])

    def source(var: str, seen: int = 0) -> tuple[str, str, str] | None:  # (block, jax name, HLO name)
        if named.get(var) or seen > 16:
            return named.get(var)
        found = [s for o in operands.get(var, ()) if (s := source(o, seen + 1))]
        return next((s for s in found if s[0] != "other"), found[0] if found else None)

    out: dict[str, list] = {p: [] for p in ("permute", "collectives", "scan_slices", "moe_priced", *GLUE_PARTS,
                                            "head")}
    for r in rows:
        if r.op == "custom-call" and "pallas_call" in r.jax_name and f"/{PERMUTE_SCOPE}/" not in r.jax_name:
            continue
        block, jax, name = (r.block, r.jax_name, r.name) if r.jax_name else source(r.name) or ("other", "", "")
        out[_part(r, block, jax, name)].append(r)
    return out


def _part(r, block: str, jax: str, name: str) -> str:
    """Which of `step_parts`' parts op row `r` is, its block, jax name and HLO name those of the op it is named by."""
    collective = any(k in n for n in (r.name, name) for k in ("all-gather", "reduce-scatter")) or \
        any(k in jax for k in ("/all_gather", "/reduce_scatter"))
    if f"/{PERMUTE_SCOPE}/" in f"{jax}/":
        return "permute"
    if collective and r.op.startswith("call-") and (r.jax_name or "reduce-scatter" in r.name):
        return "collectives"  # a collective's start and done (the second stage's too: unnamed, its own)
    if block == "other" and any(s in jax for s in SCAN_SLICES) and r.jax_name:
        return "scan_slices"
    if block == "moe" and not collective and (r.shape.lstrip("(").startswith("f32") or "/dot_general" in jax):
        return "moe_priced"
    if block in ("gdn", "attention"):
        return block
    if block == "moe" and jax.endswith("/slice") and _micro_batches(r.shape):
        return "hier_rs"
    return "head" if block in ("embed", "lm_head", "sample") else "stream"


def _micro_batches(shape: str) -> bool:
    """A micro-batch of the combine's rows: [core * chip, 1, rows, D] slices of its HIER_AXES view
    (`parallel.collectives.reduce_scatter`), [core, chip, 1, rows, D] of the ALL-ordered one."""
    dims = [d.split(",") for _, d in re.findall(r"(\w+)\[([\d,]*)\]", shape)]
    return any(len(d) == 5 or (len(d) == 4 and d[1] == "1") for d in dims)


def glue_passes(doc: dict, stage: str, step: str, text: str | None = None) -> dict[str, float]:
    """The passes `ops.glue` charges, read off a sweep entry's compiled step (`step_parts`; default its stored text):
    the bytes of each of `GLUE_PARTS` beyond what the model's own components price there (the GDN's conv,
    `gdn_conv`; the norms and residual adds, `norms`), over each computed token's GDN activations (q, k, v, z, o)
    a GDN layer, attention activations (q, gate, o, k, v) an attention layer, and residual row (D) a layer, on one
    device; the hierarchical reduce-scatter's slices over the combine's rows [N, D] (every rank's tokens) a layer."""
    from qwen35_lib.costmodel.predict import serving_model

    config = serving_model(doc["model"], **doc.get("overrides", {}))
    config = config.replace(num_layers=doc["groups"] * len(config.layer_pattern))
    entry = doc["stages"][stage]["steps"][step]
    parts = step_parts(text or stored_text(stage, step))
    m = model_side(config, stage, entry, doc["shape"])["bytes_by_component"]
    z = ops.sizes(config)
    T = entry["decode_tokens_per_rank"] + entry["prefill_tokens_per_rank"]
    gdn_row = (2 * config.gdn_num_k_heads * config.gdn_k_head_dim + 3 * config.gdn_num_v_heads
               * config.gdn_v_head_dim) * z["act"]
    attn_row = (3 * config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim * z["act"]  # DP: every head
    moved = {p: sum(r.bytes for r in parts[p]) for p in GLUE_PARTS}
    return {"gdn": (moved["gdn"] - m["gdn_conv"]) / (z["n_gdn"] * T * gdn_row),
            "attention": moved["attention"] / (z["n_attn"] * T * attn_row),
            "stream": (moved["stream"] - m["norms"]) / (config.num_layers * T * config.hidden_size * z["act"]),
            "hier_rs": moved["hier_rs"] / (config.num_layers * T * entry["ranks"] * config.hidden_size * z["act"])}
