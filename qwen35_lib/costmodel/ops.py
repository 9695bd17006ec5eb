"""Op costs from the Config: FLOPs, HBM bytes and launched ops of each block, per device, for one step.

A step is described by a `Batch` (whole slice); a `Pricing` says what one device holds and computes and how it is
priced (its share of the mesh, each slot's implementation, the measured pass factors). Each
function returns a `Cost`; `seconds(cost, specs)` is its roofline time:
    max(mxu_flops / (peak * eff_matmul) + vector_flops / (peak * vector_fraction), bytes / (bw * eff_hbm))
    + launches * op_overhead
A dense dot whose rate the specs measured by its rows (the CPU: `cpu_bench.dense_rows_flops`,
`Specs.dense_row_efficiency`) takes flops / that rate: its FLOPs stay its own, and the difference from their time at
the peak is charged beside them as peak FLOPs (`few_rows`, `Cost.extra_mxu_flops`).
Sizes come from the weight declarations (`qwen35_lib.stats`), never typed in. Kernel families change what is
moved, as data/costmodel_hardware.json 'kernels' records from the code (the MoE's: `moe_costs`):
- attention `xla` (qwen35_lib/kernels/attention/xla.py): every computed token reads the longest context of its
  group (tokens sorted by context in groups of WALK_ROWS: `walked_context`) and scores against it; `items` (the xla
  family's, `paged_attention_items`): where ITEM_COST x its items (runs of a sequence's tokens in blocks of
  ITEM_BLOCK, at most blocks + S: every one computed) is fewer than its tokens, each item reads its group's longest
  context once (items grouped so too), in steps of ITEM_KEYS keys, and scores its block's rows against it, else as
  `xla`;
  `pallas` (ragged paged attention): each sequence's context is read once;
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from qwen35_lib import plan
from qwen35_lib.config import FULL, LINEAR, Config
from qwen35_lib.costmodel.specs import Specs
from qwen35_lib.kernels.attention.xla import ITEM_BLOCK, ITEM_COST, ITEM_KEYS, WALK_ROWS
from qwen35_lib.kernels.dense.native import MAX_ROWS as NATIVE_DENSE_ROWS
from qwen35_lib.stats import model_stats

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's work for the whole slice (all data-parallel ranks together)."""

    decodes: int = 0  # decoding sequences (one new token each)
    decode_ctx: float = 0.0  # their mean context after this step (tokens in the cache, the new one included)
    prefill_tokens: int = 0  # prompt tokens of this step (chunks)
    prefill_seqs: int = 0  # sequences with a prompt chunk
    prefill_ctx: float = 0.0  # mean tokens cached before each chunk
    max_ctx: int = 0  # longest context in the batch (the XLA attention reads it for every token)
    padded_tokens: int = 0  # tokens the compiled step computes (bucket padding); 0: exactly the real ones
    logit_rows: int = 0  # rows the LM head computes; 0: one per sequence (a full forward computes every token's)
    drafts: int = 0  # speculative decoding: draft tokens each decode row verifies (a row of drafts + 1 tokens, every
    # one through every layer; every sequence's logit row drafts + 1 wide, as the verify step computes them)

    @property
    def tokens(self) -> int:
        return self.decodes * (1 + self.drafts) + self.prefill_tokens

    @property
    def rows(self) -> int:
        """Rows the LM head and the sampler compute: `logit_rows` (else one a sequence), drafts + 1 each."""
        return (self.logit_rows or max(self.seqs, 1)) * (1 + self.drafts)

    @property
    def computed(self) -> int:
        return max(self.tokens, self.padded_tokens)

    @property
    def seqs(self) -> int:
        return self.decodes + self.prefill_seqs

    def counts(self) -> Batch:
        """This batch without its contexts (`decode_ctx`, `prefill_ctx`, `max_ctx`): all that every op cost but the
        attention core reads (`step` caches those costs by it)."""
        return Batch(decodes=self.decodes, prefill_tokens=self.prefill_tokens, prefill_seqs=self.prefill_seqs,
                     padded_tokens=self.padded_tokens, logit_rows=self.logit_rows, drafts=self.drafts)

    @property
    def attention_pairs(self) -> float:
        """(query, key) pairs of causal attention: decodes see their context, chunks their past + causal part."""
        n = self.prefill_tokens / self.prefill_seqs if self.prefill_seqs else 0.0
        return self.decodes * (1 + self.drafts) * self.decode_ctx + self.prefill_tokens * self.prefill_ctx + \
            self.prefill_seqs * n * (n + 1) / 2


@dataclasses.dataclass(frozen=True)
class Pricing:
    """How one device's share of a step is priced: what it holds and computes (`dp` ranks split the tokens, `tp`
    splits heads and FFNs, `ep` the experts), each slot's implementation, and the passes each op makes."""

    dp: int = 1
    tp: int = 1
    moe: str = "local"  # "tp", "ep", "local"
    ep: int = 1
    attention: str = "xla"  # "xla", "items" or "pallas"
    moe_impl: str = "ragged_dot"  # the `moe_matmul` slot's: "ragged_dot", "capacity", "loop", "pallas", "native"
    kv_dtype: str | None = None  # None: the model dtype
    page_size: int = 256
    max_batched_tokens_per_rank: int = 0  # 0: not padded to buckets
    weight_passes: float = 1.0  # HBM passes over each dense weight byte (3 for XLA's sliced scan inputs: read, copy,
    # read); the dense projections are XLA dots in every kernel family
    router_passes: float | None = None  # the same for the router (XLA's dot on the scan's slice where the other
    # projections are read in place: kernels.pallas_router_passes); None: weight_passes
    expert_passes: float | None = None  # the same for the routed experts (a Pallas grouped matmul reads its block
    # in place: 1); None: weight_passes
    kv_read_bytes: float = 0.0  # xla attention: HBM bytes per KV element of a page it reads (the compiled page
    # loop's: kernels.xla_tpu_paged_attention_bytes); 0: the cache's own item size
    items_read_bytes: float = 0.0  # the same for the items' walk (kernels.xla_tpu_items_attention_bytes)
    static_buffers: bool = True  # the code's worst-case MoE buffers are moved whole (False: the ideal roofline)
    expert_imbalance: float = 1.0  # the busiest EP device's rows over the mean (its row work scales by it)
    gmm_tile_rows: int = 0  # the grouped matmul computes whole tiles of this many rows per expert (0: real rows)
    onehot_threshold: int = 0  # pallas: one-hot matmul permutes while N·k <= this (`moe_layer`); 0: never
    row_overhead_s: float = 0.0  # pallas: seconds a routed row of the slice costs every device (`moe_layer`)
    layer_fixed_s: float = 0.0  # pallas: seconds every layer call costs every device outside its grouped matmul,
    # whatever its rows (`moe_layer`)
    production_moe: bool = True  # pallas: tpu-inference's layer around the grouped matmul (`moe_layer`: one-hot
    # permutes, per-row overhead, SparseCore gathers); False: this library's (XLA gathers and a scatter-add)
    permute_passes: float = 2.0  # pallas: passes over the [N·k, D] routed rows around the grouped matmul
    expert_bytes_per_param: float = 0.0  # ragged_dot / capacity: HBM bytes a layer moves per local expert
    # parameter as the compiled program does (XLA:TPU's FP8 path: kernels.xla_tpu_fp8_expert_bytes); 0: the rule
    cache_copy_passes: float = 0.0  # passes over each layer's whole local cache pool a step (an engine that slices
    # each layer's pool out of a stack: kernels.engine_cache_copy_passes, measured); 0: caches updated in place
    kv_pool_bytes: float = 0.0  # one attention layer's local KV pool (the engine's allocation)
    gdn_pool_bytes: float = 0.0  # one GDN layer's local state pool
    gdn_state_passes: float = 2.0  # passes over each decoding sequence's GDN state a step (read, write; XLA:TPU's
    # gather and scatter: kernels.xla_tpu_gdn_state_passes)
    sampling_passes: float = 0.0  # passes over each sampled sequence's float32 logits [V] (the sort over the
    # vocabulary, its masks and the draw: kernels.sampling_logit_passes on TPU); 0: not charged
    combine_sum_hbm_bytes: float = 0.0  # this engine's Pallas combine: its sums [N, D] (in the activations' dtype) are
    # written to HBM once larger than this (XLA:TPU's scoped VMEM, `SCOPED_VMEM_BYTES`); 0: not charged
    gdn_glue_passes: float = 0.0  # this engine's Pallas step: the XLA ops around its kernels (`glue`), in passes
    attn_glue_passes: float = 0.0  # over a computed token's GDN / attention activations a layer, and over its
    stream_glue_passes: float = 0.0  # residual-stream row a layer (kernels.pallas_*_glue_passes); 0: not charged
    hier_rs_glue_passes: float = 0.0  # the hierarchical reduce-scatter's micro-batch slices (this engine's, XLA's
    # kernels or Pallas): passes over the combine's rows [N, D] a layer (kernels.pallas_hier_rs_glue_passes)
    gathered_relayouts: int = 0  # fused_ep: [N, D] relayouts of the all-gathered tokens a layer, in HBM once larger
    # than the scoped VMEM (`fused_combine.GATHERED_RELAYOUTS`)
    gdn_prefill: str = "chunked"  # how prompt tokens run the delta rule: "chunked" (XLA's and Pallas' chunked
    # form) or "recurrent" (the CPU's native handler, `kernels.gdn.native`: one state update per token)
    dense_row_efficiency: tuple[tuple[int, float], ...] = ()  # (rows, measured rate over the peak) of a dense dot
    # (`Specs.dense_row_efficiency`; (): every dot at the peak)


@dataclasses.dataclass(frozen=True)
class Cost:
    mxu_flops: float = 0.0
    vector_flops: float = 0.0
    bytes: float = 0.0  # streamed HBM reads and writes
    launches: float = 0.0
    copy_bytes: float = 0.0  # materialized copies (read + write bytes), e.g. XLA's sliced scan inputs
    small_mxu_flops: float = 0.0  # matmuls with few rows per batch (the CPU MoE kernel's expert slots)
    seconds: float = 0.0  # time charged directly (a per-row overhead measured as time, `moe_layer`)
    extra_mxu_flops: float = 0.0  # a dot's time at its measured rate beyond its FLOPs at the peak, in peak FLOPs
    # (`few_rows`): time, not work

    # field by field (dataclasses.astuple deep-copies: it was a seventh of a schedule simulation's time)
    def __add__(self, o: Cost) -> Cost:
        return Cost(self.mxu_flops + o.mxu_flops, self.vector_flops + o.vector_flops, self.bytes + o.bytes,
                    self.launches + o.launches, self.copy_bytes + o.copy_bytes,
                    self.small_mxu_flops + o.small_mxu_flops, self.seconds + o.seconds,
                    self.extra_mxu_flops + o.extra_mxu_flops)

    def __mul__(self, k: float) -> Cost:
        return Cost(self.mxu_flops * k, self.vector_flops * k, self.bytes * k, self.launches * k, self.copy_bytes * k,
                    self.small_mxu_flops * k, self.seconds * k, self.extra_mxu_flops * k)

    @property
    def flops(self) -> float:
        return self.mxu_flops + self.vector_flops + self.small_mxu_flops

    @property
    def hbm_bytes(self) -> float:
        return self.bytes + self.copy_bytes


def seconds(c: Cost, s: Specs, maximum=max) -> float:
    """Roofline time of `c` on one device of `s`: max(compute, memory), plus launch overheads (`maximum=np.maximum`
    for a `Cost` of arrays: the times of many steps, [n])."""
    compute = (c.mxu_flops + c.extra_mxu_flops) / (s.peak_flops * s.eff_matmul) + \
        c.vector_flops / (s.peak_flops * s.vector_fraction) + \
        c.small_mxu_flops / (s.small_matmul_flops or s.peak_flops * s.eff_matmul)
    memory = c.bytes / (s.hbm_bytes_per_s * s.eff_hbm) + \
        c.copy_bytes / (s.copy_bytes_per_s or s.hbm_bytes_per_s * s.eff_hbm)
    return maximum(compute, memory) + c.launches * s.op_overhead_s + c.seconds


def row_efficiency(table: tuple[tuple[int, float], ...], rows: float) -> float:
    """The measured rate over the peak of a matmul with `rows` rows (`Pricing.dense_row_efficiency`): linear between
    the measured rows, the nearest measured one's outside them, at most 1 (the peak is the rate of the most rows);
    1 without a table."""
    if not table or rows <= 0:
        return 1.0
    r, e = zip(*table)
    return min(1.0, float(np.interp(rows, r, e)))


def few_rows(table: tuple[tuple[int, float], ...], rows: float, flops: float) -> Cost:
    """What a matmul of `flops` with `rows` rows costs beyond its FLOPs at the peak, in peak FLOPs:
    flops x (1 / `row_efficiency` - 1)."""
    eff = row_efficiency(table, rows)
    return Cost(extra_mxu_flops=flops * (1 / eff - 1)) if eff < 1 else Cost()


def dense_rows(pr: Pricing, rows: float, flops: float) -> Cost:
    """`few_rows` of a dense projection's dot: XLA's past the native handler's rows (`kernels.dense.native`: up to
    NATIVE_DENSE_ROWS rows a panel-packed weight streams through it, priced by its bytes and the peak as before)."""
    return few_rows(pr.dense_row_efficiency, rows, flops) if rows > NATIVE_DENSE_ROWS else Cost()


@functools.lru_cache(maxsize=64)
def sizes(cfg: Config) -> dict[str, float]:
    """Per-layer parameter counts by part (from the weight declarations) and item sizes."""
    st = model_stats(cfg)
    p = st.params_by_part
    n_attn, n_gdn = cfg.layer_types.count(FULL), cfg.layer_types.count(LINEAR)
    act = ITEMSIZE[cfg.dtype]
    exp_item = 1 + 4 / cfg.fp8_block_size**2 if cfg.expert_dtype == "float8_e4m3fn" else act
    return dict(
        attn=p.get("attention", 0) / max(n_attn, 1), gdn=p.get("gdn", 0) / max(n_gdn, 1),
        router=p.get("router", 0) / cfg.num_layers, shared=p.get("shared_experts", 0) / cfg.num_layers,
        expert=3 * cfg.hidden_size * cfg.moe_ffn, embed=p.get("embed", 0), lm_head=p.get("lm_head", 0),
        norms=p.get("norms", 0), act=act, exp_item=exp_item, n_attn=n_attn, n_gdn=n_gdn)


def kv_item(cfg: Config, pr: Pricing) -> float:
    """Bytes per cached K or V element (FP8: 1 B + a float32 scale per token and head)."""
    dtype = pr.kv_dtype or cfg.dtype
    return 1 + 4 / cfg.head_dim if dtype == "float8_e4m3fn" else ITEMSIZE[dtype]


def kv_heads_per_device(cfg: Config, tp: int) -> int:
    """KV heads a device stores with heads split tp ways: Hkv / tp when it divides, else the code's `tp_kvrep`
    duplication (`plan.kv_heads_per_device`: max(1, Hkv / tp), one head per device for 2 on 8)."""
    return plan.kv_heads_per_device(cfg, tp, replicated=True)


def attention_block(cfg: Config, b: Batch, pr: Pricing) -> dict[str, Cost]:
    """One attention layer: projections (q+gate, k, v, o) and the attention core over the paged cache."""
    z = sizes(cfg)
    T = b.computed / pr.dp  # tokens this device computes
    hd, hq = cfg.head_dim, cfg.num_q_heads / pr.tp
    kvh = kv_heads_per_device(cfg, pr.tp)
    w_kv = 2 * cfg.hidden_size * cfg.num_kv_heads * hd
    w = (z["attn"] - w_kv) / pr.tp + w_kv * kvh / cfg.num_kv_heads  # params on this device
    proj = Cost(mxu_flops=2 * T * w, bytes=w * z["act"] + T * cfg.hidden_size * z["act"] * 4, launches=6,
                copy_bytes=w * z["act"] * (pr.weight_passes - 1)) + dense_rows(pr, T, 2 * T * w)
    tok_bytes = 2 * kvh * hd * kv_item(cfg, pr)  # K and V of one token on this device
    new = b.tokens / pr.dp * tok_bytes  # the KV-cache write
    qo = T * hq * hd * z["act"] * 2
    if pr.attention == "pallas":
        chunk = b.prefill_tokens / max(b.prefill_seqs, 1)
        keys = (b.decodes * b.decode_ctx + b.prefill_seqs * (b.prefill_ctx + chunk)) / pr.dp  # each context once
        pairs = b.attention_pairs / pr.dp
        core = Cost(4 * hd * hq * pairs, 5 * hq * pairs, keys * tok_bytes + new + qo, 2)
    elif (walk := xla_walk(b, pr)).items:
        keys = walk.trips * walk.keys_a_trip
        pairs = walk.rows * ITEM_BLOCK * keys  # every item's block of rows against every key of its group's loop
        read = 2 * kvh * hd * pr.items_read_bytes if pr.items_read_bytes else tok_bytes  # per (item, key) pair
        core = Cost(4 * hd * hq * pairs, 5 * hq * pairs, walk.rows * keys * read + new + qo,
                    walk.groups * 4 * walk.trips + 2)
    else:
        pairs = walk.rows * walk.walk  # every token scores (and reads) its group's longest context
        read = 2 * kvh * hd * pr.kv_read_bytes if pr.kv_read_bytes else tok_bytes  # per (token, key) pair
        core = Cost(4 * hd * hq * pairs, 5 * hq * pairs, pairs * read + new + qo, walk.groups * 4 * walk.trips + 2)
    return {"attn_proj": proj, "attn_core": core, "cache_copies": cache_copies(pr, pr.kv_pool_bytes)}


@dataclasses.dataclass(frozen=True)
class Walk:
    """The XLA attention's walk over the pages on a rank (`attention_xla.by_context`): `rows` rows (its items
    where they run, else its tokens) sorted by context in `groups` of WALK_ROWS, each group looping `trips` times
    (`keys_a_trip` keys each) up to its longest context; `walk`: the keys a row walks on average."""

    items: bool
    rows: float
    groups: int
    walk: float
    keys_a_trip: int

    @property
    def trips(self) -> int:
        return math.ceil(self.walk / self.keys_a_trip)


def xla_walk(b: Batch, pr: Pricing) -> Walk:
    """`paged_attention_items`' walk where ITEM_COST x its items is fewer than the tokens a rank computes, else the
    twin's, token by token (`walked_context`). Past one group `by_context` pads the rows to whole groups, the padding
    after the sort, so in the group of the longest contexts: the padding rows walk to the longest."""
    T = b.computed / pr.dp
    if pr.attention == "items" and ITEM_COST * (items := attention_items(b, pr.dp)) < T:
        rows, span, keys = items, ITEM_BLOCK, max(1, ITEM_KEYS // pr.page_size) * pr.page_size  # whole pages a trip
    else:
        rows, span, keys = T, 1, pr.page_size
    groups, walk = walked_context(b, pr.dp, rows, b.prefill_tokens / pr.dp / span, span)
    padded = groups * WALK_ROWS if groups > 1 else rows
    return Walk(span > 1, padded, groups, (rows * walk + (padded - rows) * b.max_ctx) / padded, keys)


def walked_context(b: Batch, dp: int, rows: float, prompt_rows: float, span: int) -> tuple[int, float]:
    """The XLA attention's walk on a rank (`attention_xla.by_context`): `rows` rows (tokens, or items of `span`
    tokens: `prompt_rows` of them a prompt's, one a decode's, the rest padding at context 0) sorted by context in
    `groups` of WALK_ROWS, each walking to its group's longest. Returns (groups, the keys a row walks on average):
    each row's own context (a decode's `decode_ctx`; a prompt row's `prefill_ctx` + half its chunk + `span` / 2)
    plus (longest - that mean) / groups, the mean group maximum of contexts spread evenly up to `max_ctx` (one
    group: the longest, for every row)."""
    groups = max(1, math.ceil(rows / WALK_ROWS))
    chunk = b.prefill_tokens / max(b.prefill_seqs, 1)
    own = (b.decodes * (1 + b.drafts) / dp * b.decode_ctx + prompt_rows * (b.prefill_ctx + (chunk + span) / 2)) / \
        max(rows, 1)
    own = min(own, b.max_ctx)
    return groups, own + (b.max_ctx - own) / groups


def attention_items(b: Batch, dp: int) -> int:
    """Items `paged_attention_items` computes on a rank: blocks of ITEM_BLOCK computed tokens + the page table's
    rows (as many as the engine's logit rows, `logit_rows`; else the batch's sequences)."""
    return math.ceil(b.computed / dp / ITEM_BLOCK) + math.ceil((b.logit_rows or b.seqs) / dp)


def gdn_block(cfg: Config, b: Batch, pr: Pricing) -> dict[str, Cost]:
    """One Gated DeltaNet layer: projections + conv, and the delta rule (recurrent for decodes; for prompt tokens
    recurrent too where `pr.gdn_prefill` says so, ~7 dk dv vector FLOPs a token and head, else chunked for
    prompt chunks: per chunk of C tokens and head ~ 2 C^2 (3 dk + 2 dv) + 6 C dk dv MXU FLOPs, plus the chunk's
    (I + A)^-1 by block doubling on whole [C, C] matrices as the Pallas kernel computes it: log2 C steps of two
    C x C x C matmuls, 4 C^3 log2 C FLOPs; the XLA twin `gdn_xla.unit_lower_inverse` now inverts the diagonal
    blocks only, C^3 / 3 multiply-adds, which this count does not yet distinguish)."""
    z = sizes(cfg)
    T = b.computed / pr.dp
    w = z["gdn"] / pr.tp
    proj = Cost(mxu_flops=2 * T * w, bytes=w * z["act"] + T * cfg.hidden_size * z["act"] * 4, launches=6,
                copy_bytes=w * z["act"] * (pr.weight_passes - 1)) + dense_rows(pr, T, 2 * T * w)
    hv = cfg.gdn_num_v_heads / pr.tp
    dk, dv, C = cfg.gdn_k_head_dim, cfg.gdn_v_head_dim, cfg.gdn_chunk_size
    state = hv * dk * dv * ITEMSIZE[cfg.gdn_state_dtype]  # one sequence's state on this device
    dec = b.decodes / pr.dp
    pre_seqs = b.prefill_seqs / pr.dp
    chunks = math.ceil(max(b.computed - b.decodes * (1 + b.drafts), 0) / pr.dp / C)  # the prefill region, C-aligned
    recurrent = Cost(vector_flops=7 * dk * dv * hv * dec * (1 + b.drafts), bytes=pr.gdn_state_passes * state * dec,
                     launches=6) + verify_checkpoints(cfg, b, pr)
    if pr.gdn_prefill == "recurrent":  # every prompt token one update of its sequence's state, held in cache
        tokens = b.prefill_tokens / pr.dp  # the real ones: the handler skips padding
        return {"gdn_proj": proj, "gdn_core": recurrent + Cost(vector_flops=7 * dk * dv * hv * tokens,
                                                                bytes=2 * state * pre_seqs),
                "gdn_conv": conv(cfg, b, pr),
                "cache_copies": cache_copies(pr, pr.gdn_pool_bytes)}
    inverse = 4 * C**3 * math.log2(C)
    chunked = Cost(mxu_flops=chunks * hv * (2 * C * C * (3 * dk + 2 * dv) + 6 * C * dk * dv + inverse),
                   bytes=2 * state * pre_seqs + chunks * C * hv * (dk + dv) * 4 * 2,
                   launches=5 * chunks + 4 if chunks else 0)
    return {"gdn_proj": proj, "gdn_core": recurrent + chunked, "gdn_conv": conv(cfg, b, pr),
            "cache_copies": cache_copies(pr, pr.gdn_pool_bytes)}


def verify_checkpoints(cfg: Config, b: Batch, pr: Pricing) -> Cost:
    """What one GDN layer's speculative verification adds for its decode rows (`b.drafts` = k > 0, V = k + 1 tokens a
    row; `kernels.gdn.xla.gdn_verify_xla`, `model.ragged.keep_accepted`), one device: each row's V states written to
    its slot's checkpoints, then the accepted one read back and written into the slot (V + 2 state passes), and its
    conv window of K - 1 + V inputs a channel written, K - 1 of them read back and written. 0 without drafts.
    This is a kernel's traffic (each row's state kept on chip over its V tokens), not yet the engine's: the Pallas
    GDN takes no drafts, and the XLA twin (`gdn_xla.gdn_verify_xla`) compiled for TPU7x moves 24 (k = 1, c512) and
    56 (k = 3, 48 rows) bf16 state sizes a row and GDN layer in its GDN block (`compiled.gdn_state_passes`' count
    on the kernels stage's verify step at 2 groups; its V checkpoints moved about 8 and 12 times over), against
    4 + V + 2 = 8 and 10 priced here; the gap is a GDN verify kernel's to close."""
    if not b.drafts:
        return Cost()
    V, K = 1 + b.drafts, cfg.gdn_conv_kernel
    state = cfg.gdn_num_v_heads / pr.tp * cfg.gdn_k_head_dim * cfg.gdn_v_head_dim * ITEMSIZE[cfg.gdn_state_dtype]
    window = cfg.gdn_conv_dim / pr.tp * sizes(cfg)["act"] * (K - 1 + V + 2 * (K - 1))
    return Cost(bytes=b.decodes / pr.dp * ((V + 2) * state + window), launches=3)


def checkpoint_bytes(cfg: Config, drafts: int, tp: int = 1) -> float:
    """Bytes of one GDN layer's verification checkpoints a sequence's slot holds (`engine.cache.declare_cache`'s
    `*_ckpt` pools at verify = drafts + 1), heads split `tp` ways: V states and a conv window of K - 1 + V inputs."""
    if not drafts:
        return 0.0
    V, K = 1 + drafts, cfg.gdn_conv_kernel
    state = cfg.gdn_num_v_heads / tp * cfg.gdn_k_head_dim * cfg.gdn_v_head_dim * ITEMSIZE[cfg.gdn_state_dtype]
    return V * state + (K - 1 + V) * cfg.gdn_conv_dim / tp * sizes(cfg)["act"]


def conv(cfg: Config, b: Batch, pr: Pricing) -> Cost:
    """One GDN layer's causal conv over its q, k, v channels: each token's input read and output written, each
    sequence's K - 1 previous inputs read and written back (the least any engine moves; `model.deltanet.ragged_conv`
    moves that at decode)."""
    C = cfg.gdn_conv_dim / pr.tp
    rows = 2 * b.computed / pr.dp + 2 * b.seqs / pr.dp * (cfg.gdn_conv_kernel - 1)
    return Cost(vector_flops=2 * cfg.gdn_conv_kernel * b.computed / pr.dp * C, bytes=rows * C * sizes(cfg)["act"],
                launches=2)


def sampling(cfg: Config, b: Batch, pr: Pricing) -> Cost:
    """The sampler over each sequence's float32 logits [V] (the whole vocabulary on every device):
    `pr.sampling_passes` passes."""
    S = b.rows / pr.dp
    return Cost(bytes=pr.sampling_passes * S * cfg.vocab_size * 4, launches=1 if pr.sampling_passes else 0)


def cache_copies(pr: Pricing, pool_bytes: float) -> Cost:
    """What an engine's layer loop pays for one layer's cache pool a step: `pr.cache_copy_passes` passes over the
    whole pool (a slice copied out of a stacked cache and written back), whatever the batch; 0 in place."""
    return Cost(copy_bytes=pr.cache_copy_passes * pool_bytes, launches=2 if pr.cache_copy_passes else 0)


def glue(cfg: Config, b: Batch, pr: Pricing) -> Cost:
    """What this engine's Pallas step moves in XLA's ops around its kernels, the whole step on one device, beyond
    what the components price (the conv, the norms): relayouts of the projections' outputs for the kernels, the
    GDN's float32 gate and gated norm, the prefill region's slices and head-major transposes, the attention's
    rotary and KV-write layouts, the residual stream's copies and prefetches between kernels and the hierarchical
    reduce-scatter's micro-batches sliced out of the combine and put back: `pr.*_glue_passes` (measured off the
    compile, kernels.pallas_*_glue_passes) over each computed token's GDN activations (q, k, v, z, o), attention
    activations (q, gate, o, k, v) and residual row (D), per layer of each kind, and, under the hierarchical
    reduce-scatter, over the combine's rows [N, D] of every rank's tokens a layer. Bytes only: its many small ops'
    launches are not charged."""
    z = sizes(cfg)
    T = b.computed / pr.dp
    hv, hk = cfg.gdn_num_v_heads / pr.tp, cfg.gdn_num_k_heads / pr.tp
    gdn_row = (2 * hk * cfg.gdn_k_head_dim + 3 * hv * cfg.gdn_v_head_dim) * z["act"]
    attn_row = (3 * cfg.num_q_heads / pr.tp + 2 * kv_heads_per_device(cfg, pr.tp)) * cfg.head_dim * z["act"]
    moved = T * (pr.gdn_glue_passes * gdn_row * z["n_gdn"] + pr.attn_glue_passes * attn_row * z["n_attn"]
                 + pr.stream_glue_passes * cfg.hidden_size * z["act"] * cfg.num_layers)
    moved += pr.hier_rs_glue_passes * b.computed * cfg.hidden_size * z["act"] * cfg.num_layers
    return Cost(bytes=moved)


def norms(cfg: Config, b: Batch, pr: Pricing) -> Cost:
    """The two RMSNorms of a layer (and residual adds): element-wise passes over [T, D]."""
    T = b.computed / pr.dp
    return Cost(0, 8 * T * cfg.hidden_size * 2, T * cfg.hidden_size * sizes(cfg)["act"] * 4, 2)


def embed_and_head(cfg: Config, b: Batch, pr: Pricing) -> Cost:
    """Embedding gather for every token; final norm and LM head for each sequence's last token (vocab split
    over tp)."""
    z = sizes(cfg)
    T, S = b.computed / pr.dp, b.rows / pr.dp
    w = z["lm_head"] / pr.tp
    return Cost(2 * S * w, 0, w * z["act"] + T * cfg.hidden_size * z["act"] + S * cfg.vocab_size / pr.tp * 4, 4) + \
        dense_rows(pr, S, 2 * S * w)
