"""costmodel.step: one decode step's HBM bytes against hand arithmetic, what each collective stage changes per
layer, and `step_times` (a schedule's steps at once) giving step_time's floats."""

from __future__ import annotations

import dataclasses

import pytest

from qwen35_lib import costmodel, get_config, model_stats
from qwen35_lib.costmodel import collectives as cc
from qwen35_lib.costmodel import moe_costs, ops, specs
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms, extremes
from qwen35_lib.costmodel.predict import serving_model
from qwen35_lib.costmodel.specs import kernel_facts
from qwen35_lib.costmodel.step import Pools, pricing, step_costs, step_time, step_times
from qwen35_lib.plan import STAGES, ServingPlan, any_stage
from tests.costmodel.toy import BATCHES, toy


def test_decode_step_hbm_bytes():
    """One decode token of the 397B model on one device with the Pallas kernels: the weights it reads (every
    dense weight of the layer scan `pallas_dense_weight_passes` times, measured: the Pallas projection reads the
    stacks in place, about once; exactly k experts per layer in FP8, read in place; the LM head once) plus its
    context's KV and GDN state, and what this engine's XLA glue moves: every expert's FP8 scales expanded along
    lanes each layer for the grouped matmul (and the k experts' read by it), the sampler's passes over the logits,
    the conv's inputs, outputs and history; the router, still XLA's dot on the scan's slice, its passes."""
    cfg = costmodel.serving_model()
    st = model_stats(cfg).params_by_part
    D, F, k, L = cfg.hidden_size, cfg.moe_ffn, cfg.num_experts_per_tok, cfg.num_layers
    passes = kernel_facts()["pallas_dense_weight_passes"]["value"]
    router = kernel_facts()["pallas_router_passes"]["value"]  # XLA's dot on the scan's slice
    dense = passes * (st["attention"] + st["gdn"] + st["shared_experts"]) + router * st["router"] + st["lm_head"]
    fp8 = 1 + 4 / 128**2  # one float32 scale per 128 x 128 block
    ctx = 1000
    kv = 15 * ctx * 2 * cfg.num_kv_heads * cfg.head_dim * (1 + 4 / cfg.head_dim)  # FP8 KV with per-token scales
    state = 45 * 2 * cfg.gdn_num_v_heads * cfg.gdn_k_head_dim * cfg.gdn_v_head_dim * 2  # bf16, read + written
    b, E, C = cfg.fp8_block_size, cfg.num_experts, cfg.gdn_conv_dim
    expanded = 4 * (D // b * 2 * F + F // b * D)  # one expert's scales repeated along 128 lanes
    glue = L * (E * expanded * (1 + 1 / b) + k * expanded) + \
        kernel_facts()["sampling_logit_passes"]["value"] * cfg.vocab_size * 4 + 45 * (2 + 2 * 3) * C * 2
    hand = 2 * dense + L * k * 3 * D * F * fp8 + kv + state + glue
    one = toy(chips=1)
    got = step_time(cfg, one, STAGES["kernels"], ops.Batch(decodes=1, decode_ctx=ctx, max_ctx=ctx),
                    kv_dtype="float8_e4m3fn")
    assert got.hbm_bytes == pytest.approx(hand, rel=0.01)  # activations are the rest
    xla = step_time(cfg, one, STAGES["baseline"], ops.Batch(decodes=1, decode_ctx=ctx, max_ctx=ctx),
                    kv_dtype="float8_e4m3fn")
    assert xla.hbm_bytes > 3 * got.hbm_bytes  # XLA: every expert, dequantized copies, sliced weights


def test_stage_collectives_per_layer():
    """fused_ag saves one all-gather's launch and hops; it moves the weights as float32 bits packed beside the
    int32 ids (8k bytes a token) where the unfused gathers send them in the model dtype (4k + 2k for bf16)."""
    cfg = costmodel.serving_model()
    s = specs.get("tpu7x-8")
    b = ops.Batch(decodes=512, decode_ctx=2000, max_ctx=2000)
    t = {n: step_time(cfg, s, STAGES[n], b, "float8_e4m3fn") for n in ("replicate", "fused_ag", "hier_rs")}
    saved = t["replicate"].breakdown["all_gather"] - t["fused_ag"].breakdown["all_gather"]
    k, n = cfg.num_experts_per_tok, 512 // 8  # tokens a device routes
    ag = lambda nbytes: cc.all_gather(s, nbytes).seconds  # noqa: E731
    assert saved == pytest.approx(cfg.num_layers * (ag(n * k * 4) + ag(n * k * 2) - ag(n * k * 8)), rel=1e-6)
    assert saved < cfg.num_layers * (s.collective_launch_s + 7 * s.hop_latency_s)
    assert t["fused_ag"].wire_bytes - t["replicate"].wire_bytes == pytest.approx(cfg.num_layers * 7 * n * k * 2)
    assert t["hier_rs"].breakdown["reduce_scatter"] < t["fused_ag"].breakdown["reduce_scatter"]


def test_cpu_engine_step_reads_weights_and_caches_in_place_and_runs_the_native_gdn():
    """On one CPU device the engine's step is an unrolled loop over per-layer weights and caches
    (`layer_loop.unrolled`): each dense weight byte is read once and no cache pool is copied; its native GDN handler
    gives every prompt token one state update (~7 dk dv vector FLOPs a head). The same plan on a TPU scans: the
    sliced weights' copies and the chunked form (MXU FLOPs); its caches are rows of one pool a kind, in place too
    (`kernels.engine_cache_copy_passes`: 0, measured)."""
    cfg = get_config("qwen3.5-mini", dtype="float32")
    plan = ServingPlan("single", "tp8_kvrep")
    pools = Pools(kv=1e6, gdn=2e6)
    decode = ops.Batch(decodes=8, decode_ctx=96, max_ctx=96)
    cpu, tpu = (step_costs(cfg, toy(chips=1, kind=kind), plan, decode, pools=pools) for kind in ("cpu", "tpu"))
    dense = ("attn_proj", "gdn_proj", "router", "shared_expert")
    assert all(cpu[c].copy_bytes == 0 for c in dense) and all(tpu[c].copy_bytes > 0 for c in dense)
    z = ops.sizes(cfg)
    passes = kernel_facts()["xla_weight_passes"]["value"]
    assert tpu["gdn_proj"].copy_bytes == pytest.approx((passes - 1) * z["n_gdn"] * z["gdn"] * 4)  # slices copied
    assert cpu["cache_copies"].copy_bytes == 0
    assert tpu["cache_copies"].copy_bytes == 0

    prompt = ops.Batch(prefill_tokens=64, prefill_seqs=1, max_ctx=64)
    cpu, tpu = (step_costs(cfg, toy(chips=1, kind=kind), plan, prompt) for kind in ("cpu", "tpu"))
    per_token = 7 * cfg.gdn_k_head_dim * cfg.gdn_v_head_dim * cfg.gdn_num_v_heads
    assert cpu["gdn_core"].vector_flops == pytest.approx(z["n_gdn"] * 64 * per_token)
    assert cpu["gdn_core"].mxu_flops == 0 and tpu["gdn_core"].mxu_flops > 0


@pytest.mark.parametrize("stage", ["baseline", "kernels"])
def test_every_cost_but_the_attention_layers_reads_only_the_token_counts(stage):
    """`step` caches the GDN, MoE, norm and head costs by `Batch.counts()`: the same counts with other contexts must
    give the same costs there (and different ones in the attention core, so the check can tell), and step_costs
    must equal the ops summed by hand, on the real pricing and on the ideal one."""
    cfg = costmodel.serving_model()
    s = specs.get("tpu7x-8")
    short = ops.Batch(decodes=64, decode_ctx=300, prefill_tokens=512, prefill_seqs=2, prefill_ctx=100, max_ctx=900)
    long = dataclasses.replace(short, decode_ctx=7000, prefill_ctx=4000, max_ctx=8000)
    assert long.counts() == short.counts() and short.counts().max_ctx == 0
    for ideal in (False, True):
        a, b = (step_costs(cfg, s, STAGES[stage], x, "float8_e4m3fn", ideal=ideal) for x in (short, long))
        assert a["attn_core"] != b["attn_core"]
        assert {k: v for k, v in a.items() if k != "attn_core"} == {k: v for k, v in b.items() if k != "attn_core"}
    pr = pricing(cfg, s, STAGES[stage], "float8_e4m3fn")
    z = ops.sizes(cfg)
    hand = {}
    for costs, times in ((ops.attention_block(cfg, long, pr), z["n_attn"]), (ops.gdn_block(cfg, long, pr), z["n_gdn"]),
                         (moe_costs.moe_block(cfg, long, pr), cfg.num_layers),
                         ({"norms": ops.norms(cfg, long, pr)}, cfg.num_layers),
                         ({"embed_lm_head": ops.embed_and_head(cfg, long, pr), "sampling": ops.sampling(cfg, long, pr),
                           "glue": ops.glue(cfg, long, pr)}, 1)):
        for name, c in costs.items():
            hand[name] = hand[name] + c * times if name in hand else c * times
    assert step_costs(cfg, s, STAGES[stage], long, "float8_e4m3fn") == hand


# --- a schedule's steps at once ---------------------------------------------------------------------------------



@pytest.mark.parametrize("stage", ["baseline", "fused_ag", "kernels"])
def test_step_times_are_step_time_exactly(stage):
    cfg, sp, st = serving_model(), specs_lib.get("tpu7x-8"), any_stage(stage)
    nom, pools = Mechanisms.nominal(), Pools(kv=1e8, gdn=2e7)
    for mech, ideal in [(None, False), (None, True), (nom, False)] + [(m, False) for _, _, m in extremes(nom)]:
        secs, parts = step_times(cfg, sp, st, BATCHES, "float8_e4m3fn", mech=mech, ideal=ideal, pools=pools)
        for i, b in enumerate(BATCHES):
            one = step_time(cfg, sp, st, b, "float8_e4m3fn", mech=mech, ideal=ideal, pools=pools)
            assert secs[i] == one.seconds and {k: v[i] for k, v in parts.items()} == one.breakdown, (mech, b)
            assert list(parts) == list(one.breakdown)


def test_the_cost_model_prices_each_slots_bound_implementation():
    """The pricing reads the bound plan's kernel of each slot, and its facts by implementation: the `kernels` stage
    with `moe_kernel="ragged_dot"` is priced as XLA's grouped matmul (what runs), not the family's Pallas kernel; a
    layout plan that names no family is priced with each slot the platform's default."""
    cfg, sp = serving_model(), specs_lib.get("tpu7x-8")
    facts = kernel_facts()
    gmm = pricing(cfg, sp, STAGES["kernels"])
    ragged = pricing(cfg, sp, STAGES["kernels"].replace(moe_kernel="ragged_dot"))
    assert (gmm.moe_impl, gmm.expert_passes) == ("pallas", facts["pallas_weight_passes"]["value"])
    assert (ragged.moe_impl, ragged.expert_passes) == ("ragged_dot", facts["xla_weight_passes"]["value"])
    assert ragged.attention == gmm.attention == "pallas"
    layout = pricing(cfg, sp, any_stage(ServingPlan("dp8_ep8", "dp8_ep8", "replicate", kernels=None)))
    assert (layout.attention, layout.moe_impl) == ("pallas", "pallas")  # TPU's defaults (`plan.kernels`)
    doc = costmodel.predict(stage=ServingPlan("dp8_ep8", "dp8_ep8", "replicate", kernels=None), isl=1024, osl=1024,
                            concurrency=8)
    assert doc["fits"] and doc["total_tokens_per_s"] > 0
