"""costmodel.compiled: the model's FLOPs and HBM bytes beside the full-depth TPU7x-8 decode compiles of every ladder
stage (data/aot/tpu7x-8.json, their HLO texts in data/aot/hlo/: `python -m qwen35_lib.aot sweep --hlo-dir ...`)."""

import pytest

from qwen35_lib import data
from qwen35_lib.costmodel import compiled
from qwen35_lib.costmodel.specs import kernel_facts
from qwen35_lib.plan import LADDER

DOC = data.read_json("aot/tpu7x-8.json")


@pytest.fixture(scope="module")
def compared():
    return compiled.compare(DOC)


@pytest.fixture(scope="module")
def rows(compared):
    return {r["stage"]: r for r in compared if r["step"] == "decode"}


@pytest.fixture(scope="module")
def mixed(compared):
    return {r["stage"]: r for r in compared if r["step"] == "mixed"}


def test_every_stage_has_a_compiled_decode_step_read_from_its_text(rows):
    assert set(rows) == set(LADDER)
    assert all(r["text_bytes"] > 0 for r in rows.values())
    # the baseline's decode does not fit at the serving shape: it is read at its largest pool that does
    assert rows["baseline"]["context_len"] == DOC["stages"]["baseline"]["largest_pool"]["tokens_per_seq"]


@pytest.mark.parametrize("stage", [s for s in LADDER if s != "baseline"])
def test_the_flops_are_the_compiles_once_ragged_dot_is_counted_as_xla_counts_it(rows, stage):
    # XLA counts every gathered row of the grouped matmul against the device's experts (the Pallas kernel states
    # the same count), and the layer scan's body once: the model's one group, within 5%
    assert rows[stage]["flops_ratio"] == pytest.approx(1.0, abs=0.05), compiled.table([rows[stage]])


@pytest.mark.xfail(strict=True, reason="the TP baseline's decode: model 271.6 GFLOP against XLA's 328.2 (x0.83), "
                   "not yet explained")
def test_the_baseline_flops_are_the_compiles(rows):
    assert rows["baseline"]["flops_ratio"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("stage", LADDER)
def test_decode_hbm_bytes_within_25_percent(rows, stage):
    # issue 30 item 4: the whole step's bytes, the model's against the HLO text's (a Pallas stage's around its
    # Mosaic calls): the differences the model did not charge before are now its compiled facts (the module doc)
    assert abs(rows[stage]["bytes_ratio"] - 1) <= compiled.DECODE_BYTES_TOLERANCE, compiled.table([rows[stage]])


def test_the_kernels_stage_decode_bytes_are_the_models_within_15_percent(rows):
    # issue 50 item 2: around its Mosaic calls the kernels stage's decode moves what the model prices (its permute
    # with the Pallas combine, router, norms, LM head, sampler, the conv's rows, the FP8 scales' expansion, the
    # collectives' buffers, the XLA glue around its kernels at the mixed step's passes: x1.06); before the conv's
    # decode path, the VMEM-aware count and those components: 0.41; before the glue: 0.89
    assert abs(rows["kernels"]["bytes_ratio"] - 1) <= 0.15, compiled.table([rows["kernels"]])


def test_the_kernels_stage_mixed_bytes_are_the_models_within_15_percent(mixed):
    # issue 50 item 2: around its Mosaic calls the mixed step (1,088 tokens a rank) moves what the model prices: its
    # permute with the combine's float32 sums in HBM (too large for VMEM), and the XLA glue around its Pallas kernels
    # (`ops.glue`, measured off this text: `test_the_glue_passes_are_read_off_the_kernels_mixed_compile`); was 0.80
    # (0.67 once the count read the SparseCore's gathered rows) before the sums and the glue were priced
    assert abs(mixed["kernels"]["bytes_ratio"] - 1) <= 0.15, compiled.table([mixed["kernels"]])


def test_the_glue_passes_are_read_off_the_kernels_mixed_compile():
    # the passes `ops.glue` charges, measured on the kernels stage's mixed step; they are the mixed step's, where its
    # arrays no longer fit VMEM: the decode step's (64 tokens a rank) are lower, so charging them to every computed
    # token overstates a decode step (its bytes x1.06 of its text, within 15% above; the attention's by the most)
    facts = kernel_facts()
    measured = compiled.glue_passes(DOC, "kernels", "8k/1k mixed")
    decode = compiled.glue_passes(DOC, "kernels", "8k/1k decode")
    for part in compiled.GLUE_PARTS:
        assert facts[f"pallas_{part}_glue_passes"]["value"] == pytest.approx(measured[part], abs=0.01), part
        assert 0 < decode[part] <= measured[part], part
    # the residual stream's glue is nearly the same per token at decode (15.7) and in the mixed step (15.8)
    assert decode["stream"] == pytest.approx(measured["stream"], rel=0.02)


def test_the_fused_ep_steps_relay_the_gathered_tokens_out_twice_a_layer():
    # the fused_ep stage's mixed text: SparseCore data-format calls (async relayouts) of arrays of the all-gathered
    # tokens' size [N, D], each read and written: `fused_combine.GATHERED_RELAYOUTS` a MoE layer
    from qwen35_lib.aot.sweep import serving_config
    from qwen35_lib.costmodel.fused_combine import GATHERED_RELAYOUTS

    beyond = data.read_json("aot/tpu7x-8-beyond.json")
    cfg = serving_config(beyond["model"])
    e = beyond["stages"]["fused_ep"]["steps"]["8k/1k mixed"]
    gathered = e["ranks"] * (e["decode_tokens_per_rank"] + e["prefill_tokens_per_rank"]) * cfg.hidden_size * 2
    rows = compiled.step_parts(compiled.stored_text("fused_ep", "8k/1k mixed"))["stream"]
    moved = sum(r.bytes for r in rows if "sparse-core-data-format-call" in r.name and r.bytes == r.runs * gathered)
    assert moved / (2 * gathered * beyond["groups"] * 4) == pytest.approx(GATHERED_RELAYOUTS, abs=0.01)


def test_the_permute_is_the_compiles_at_decode_and_in_the_mixed_step(compared):
    # the model's permute (the fact's 3 passes over the routed rows, and in the mixed step the combine's float32 sums
    # [8704, 4096] written, read and cast: too large for the scoped VMEM) against the text's PERMUTE_SCOPE ops; the
    # SparseCore gather of the mixed step read as the rows it gathers (`parallel.hlo.op_rows`)
    for r in (r for r in compared if r["stage"] == "kernels"):
        text = sum(o.bytes for o in compiled.step_parts(compiled.stored_text("kernels", f"8k/1k {r['step']}"))
                   ["permute"])
        assert r["model_bytes_by_component"]["permute"] / text == pytest.approx(1.0, abs=0.02), r["step"]


def test_the_fused_ep_steps_are_priced_by_the_kernels_stages_glue_within_15_percent():
    # the fused_ep stage's steps (data/aot/tpu7x-8-beyond.json): another compile, the same GDN, attention and residual
    # stream code around its kernels, priced with the glue measured on the kernels stage's mixed step (was x0.27 for
    # the mixed step, unpriced; its decode x0.81)
    beyond = {r["step"]: r for r in compiled.compare(data.read_json("aot/tpu7x-8-beyond.json"))}
    assert all(abs(r["bytes_ratio"] - 1) <= 0.15 for r in beyond.values()), compiled.table(list(beyond.values()))


def test_a_pallas_stage_is_compared_around_its_mosaic_calls(rows):
    k = rows["kernels"]
    assert k["mosaic_bytes"] > 0 and k["without"] == sorted(c for cs in compiled.MOSAIC_COMPONENTS.values() for c in cs)
    assert all(rows[s]["mosaic_bytes"] == 0 and not rows[s]["without"] for s in LADDER if s != "kernels")


def test_the_engine_charges_no_cache_copies_and_the_compile_holds_none():
    # the engine's caches are rows of one pool a kind (kernels.engine_cache_copy_passes = 0): no stage is charged a
    # copy, and no stored step's layer loop copies a KV or GDN pool, in any stage (the XLA attention's FP8 pool
    # stored as uint32 words: `attention_xla.kv_words`). One relayout is left, not charged: the XLA stages' mixed
    # steps relay the FP8 scale pool out once a layer (f32[34575, 4, 256], 142 MB a device: 4.2 GB of dp_ep's
    # 2,901 GB mixed step, 0.15%), for the items' gather of a page's scales
    assert kernel_facts()["engine_cache_copy_passes"]["value"] == 0
    copied = {(stage, step): e["cache_pools_copied"] for stage, s in DOC["stages"].items()
              for step, e in s["steps"].items() if "cache_pools_copied" in e}
    assert {(s, f"8k/1k {k}") for s in LADDER for k in ("decode", "mixed") if s != "baseline"} <= set(copied)
    assert all(set(pools) <= {"kv_scale"} for pools in copied.values()), copied
    xla_dp = [s for s in LADDER if s not in ("baseline", "kernels")]
    mixed = {(s, f"{w} mixed") for s in xla_dp for w in ("8k/1k", "1k/8k")}
    assert {k for k, pools in copied.items() if pools} == mixed


def test_a_one_group_sweep_is_refused():
    with pytest.raises(ValueError, match="full-depth sweep"):
        compiled.compare(dict(DOC, groups=1))


def test_the_mixed_steps_with_texts_are_compared_too(mixed):
    assert {"fused_ag", "kernels"} <= set(mixed)
    assert all(abs(r["flops_ratio"] - 1) <= 0.05 for r in mixed.values()), compiled.table(list(mixed.values()))


def test_the_dense_weight_passes_are_read_off_the_compiles():
    # the passes over the dense weights the model charges the layer scan, by the plan's `dense` kernel: XLA's dots
    # on the scan's slices (dp_ep's text; its FP8 expert slices are not dense weights), the Pallas projection
    # reading the stacks in place (the kernels stage's: only the small per-layer vectors are still sliced), and the
    # router there, still XLA's dot on the scan's slice: sliced, written, read
    from qwen35_lib.aot.sweep import serving_config

    cfg = serving_config(DOC["model"])
    xla = compiled.scan_weight_passes(compiled.stored_text("dp_ep", "8k/1k decode"), cfg, "dp_ep")
    kernels = compiled.stored_text("kernels", "8k/1k decode")
    pallas, router = compiled.scan_weight_passes(kernels, cfg, "kernels"), compiled.router_passes(kernels, cfg)
    assert kernel_facts()["xla_weight_passes"]["value"] == pytest.approx(xla, abs=0.01)
    assert kernel_facts()["pallas_dense_weight_passes"]["value"] == pytest.approx(pallas, abs=0.01)
    assert kernel_facts()["pallas_router_passes"]["value"] == pytest.approx(router, abs=0.01)
    assert pallas < 1.05 < router < xla


def test_the_sampling_passes_are_read_off_the_kernels_compile():
    # the sampler's costlier branch (the sort over the vocabulary and its masks) over the logits of the 64
    # sequences a device samples
    from qwen35_lib.aot.sweep import serving_config

    measured = compiled.sampling_passes(compiled.stored_text("kernels", "8k/1k decode"), serving_config(DOC["model"]),
                                        DOC["shape"]["requests"] // DOC["stages"]["kernels"]["steps"]["8k/1k decode"]
                                        ["ranks"])
    assert kernel_facts()["sampling_logit_passes"]["value"] == pytest.approx(measured, abs=0.05)
    assert 1 < measured < 100


def test_the_permute_passes_are_read_off_the_kernels_compile():
    # the routed rows [N·k, D] the kernels stage's dispatch and combine move (`parallel.routing.PERMUTE_SCOPE`):
    # about production's 2 (written once, read once) plus the combine's float32 output and its cast
    from qwen35_lib.aot.sweep import serving_config

    step = DOC["stages"]["kernels"]["steps"]["8k/1k decode"]
    tokens = step["decode_tokens_per_rank"] * step["ranks"]  # replicate routing: every device routes them all
    text = compiled.stored_text("kernels", "8k/1k decode")
    measured = compiled.permute_passes(text, serving_config(DOC["model"]), tokens)
    assert kernel_facts()["kernels_moe_permute_passes"]["value"] == pytest.approx(measured, abs=0.01)
    assert 2 <= measured < 8.3  # production: 2; this engine before its routing gathered rows once: 8.3


def test_the_xla_kernels_facts_are_read_off_the_xla_compiles():
    # what the XLA stages' kernels move per value they need, from the dp_ep stage's texts: the attention's walk over
    # the pages per KV value read (the twin at decode: a token's page a trip; items in the mixed step: an item's
    # page a trip, the items padded to whole groups of WALK_ROWS), the FP8 experts per parameter and layer, the GDN
    # decode per state
    from qwen35_lib.aot.sweep import serving_config
    from qwen35_lib.kernels.attention.xla import ITEM_BLOCK, WALK_ROWS

    cfg = serving_config(DOC["model"])
    decode, mixed = (DOC["stages"]["dp_ep"]["steps"][f"8k/1k {s}"] for s in ("decode", "mixed"))
    page, width = DOC["shape"]["page_size"], 2 * cfg.num_kv_heads * cfg.head_dim  # dp_ep: every KV head a device
    seqs = DOC["shape"]["requests"] // decode["ranks"]
    text = compiled.stored_text("dp_ep", "8k/1k decode")
    twin = compiled.paged_attention_bytes(text, cfg, decode["decode_tokens_per_rank"], width, page)
    tokens = mixed["decode_tokens_per_rank"] + mixed["prefill_tokens_per_rank"]
    n_items = -(-tokens // ITEM_BLOCK) + seqs
    walked = -(-n_items // WALK_ROWS) * WALK_ROWS  # the items padded to whole groups
    items = compiled.paged_attention_bytes(compiled.stored_text("dp_ep", "8k/1k mixed"), cfg, walked, width, page)
    experts = compiled.fp8_expert_bytes(text, cfg, cfg.num_experts // decode["ranks"])
    # the TP baseline's (its decode at the largest pool): every expert's 1/8 slice, as many parameters a device
    experts_tp = compiled.fp8_expert_bytes(compiled.stored_text("baseline", "pool decode"), cfg, cfg.num_experts // 8)
    gdn = compiled.gdn_state_passes(text, cfg, seqs)
    facts = kernel_facts()
    assert facts["xla_tpu_paged_attention_bytes"]["value"] == pytest.approx(twin, abs=0.05)
    assert facts["xla_tpu_items_attention_bytes"]["value"] == pytest.approx(items, abs=0.05)
    assert facts["xla_tpu_fp8_expert_bytes"]["value"] == pytest.approx(experts, abs=0.05)
    assert facts["xla_tpu_fp8_expert_bytes_tp"]["value"] == pytest.approx(experts_tp, abs=0.05)
    assert facts["xla_tpu_gdn_state_passes"]["value"] == pytest.approx(gdn, abs=0.05)
    assert 1 < twin and 1 < items and 3 < experts_tp < experts and 2 <= gdn  # more than one read of what each needs
