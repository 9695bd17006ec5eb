"""The MTP head's draft step's op costs, per device (`ops`' Batch, Pricing and Cost; its layer's MoE from
`moe_costs`)."""

from __future__ import annotations

from qwen35_lib.config import Config
from qwen35_lib.costmodel.moe_costs import moe_block
from qwen35_lib.costmodel.ops import Batch, Cost, Pricing, attention_block, dense_rows, norms, sizes
from qwen35_lib.weights import mtp_layer_config


def mtp_head(cfg: Config, b: Batch, pr: Pricing) -> dict[str, Cost]:
    """The MTP head's draft step after a verify step of `b` (`b.drafts` = k > 0; `engine.speculative.draft_step`),
    one device, by the components of the layers it runs (its own layer's pieces under their own names):
    1. pass 1, over every token the step computed: the token's embedding gathered, two RMSNorms and the fc [2D -> D],
       one full-attention layer (its own KV pool written and read: `attention_block`) with its MoE (`moe_block`),
       the final norm and the shared LM head at each sequence's last kept token (one row a sequence), argmax;
    2. passes 2..k: the same for one token a decoding sequence (the draft before), at context + i - 1.
    {} without drafts."""
    if not b.drafts:
        return {}
    head = mtp_layer_config(cfg)
    z = sizes(head)
    D = cfg.hidden_size
    seqs = max(b.seqs, 1)
    passes = [(b, seqs)] + [
        (Batch(decodes=b.decodes, decode_ctx=b.decode_ctx + i, max_ctx=b.max_ctx + i), b.decodes)
        for i in range(1, b.drafts)]
    out: dict[str, Cost] = {}
    for p, rows in passes:
        T, S = p.computed / pr.dp, rows / pr.dp
        fc = Cost(2 * T * 2 * D * D, 0, 2 * D * D * z["act"] + T * D * z["act"] * 5, 4) + \
            dense_rows(pr, T, 2 * T * 2 * D * D)  # embed, 2 norms, fc
        w = z["lm_head"] / pr.tp
        lm = Cost(2 * S * w, 0, w * z["act"] + S * cfg.vocab_size / pr.tp * 4, 3) + dense_rows(pr, S, 2 * S * w)
        for name, c in (*attention_block(head, p, pr).items(), *moe_block(head, p, pr).items(),
                        ("norms", norms(head, p, pr) + fc), ("embed_lm_head", lm)):
            out[name] = out[name] + c if name in out else c
    return out
