"""costmodel.mtp_costs: the MTP head's draft step priced as its layers (k passes, each about one main layer's MoE and
the replicated LM head once), nothing without drafts."""

from __future__ import annotations

import dataclasses

from qwen35_lib.costmodel import moe_costs, mtp_costs, ops, specs, step
from qwen35_lib.costmodel.predict import serving_model
from qwen35_lib.plan import any_stage

CFG = serving_model()
TPU = specs.get("tpu7x-8")
DECODE = ops.Batch(decodes=512, decode_ctx=4096.0, max_ctx=8192)


def test_the_mtp_head_is_one_attention_layer_with_its_moe_and_the_lm_head_per_draft():
    b = dataclasses.replace(DECODE, drafts=3)
    pr = step.pricing(CFG, TPU, any_stage("kernels"), "float8_e4m3fn", 256)
    head = mtp_costs.mtp_head(CFG, b, pr)
    assert mtp_costs.mtp_head(CFG, DECODE, pr) == {}
    moe = moe_costs.moe_block(CFG, DECODE, pr)["routed_experts"].hbm_bytes  # one main layer's experts at c512
    assert 2.5 * moe < head["routed_experts"].hbm_bytes < 3.5 * moe  # k = 3 passes, each about one layer's
    lm = ops.sizes(CFG)["lm_head"] * 2  # the replicated LM head, bf16, read once a pass
    assert 3 * lm < head["embed_lm_head"].hbm_bytes < 3 * lm * 1.2
