"""costmodel.ops: the roofline of one op (compute- or bytes-bound), the CPU regimes' measured rates, the sizes."""

from __future__ import annotations

import pytest

from qwen35_lib import get_config
from qwen35_lib.costmodel import moe_costs, ops
from tests.costmodel.toy import GB, toy


def test_matmul_roofline():
    s = toy()
    # [M, K] x [K, N] in bf16: 2 M K N FLOPs; reads both operands and writes the output once
    M, K, N = 4096, 8192, 8192
    flops, nbytes = 2 * M * K * N, 2 * (M * K + K * N + M * N)
    big = ops.Cost(mxu_flops=flops, bytes=nbytes)
    assert ops.seconds(big, s) == pytest.approx(flops / (100e12 * 0.5))  # 10.99 ms of compute > 0.29 ms of bytes
    M = 8  # a decode-sized matmul: the weights' bytes dominate
    flops, nbytes = 2 * M * K * N, 2 * (M * K + K * N + M * N)
    small = ops.Cost(mxu_flops=flops, bytes=nbytes)
    assert ops.seconds(small, s) == pytest.approx(nbytes / (1e12 * 0.8))
    assert ops.seconds(ops.Cost(), s.replace(op_overhead_s=1e-5)) == 0.0
    assert ops.seconds(ops.Cost(launches=3), s.replace(op_overhead_s=1e-5)) == pytest.approx(3e-5)


def test_mini_fits_cpu_sizes():
    cfg = get_config("qwen3.5-mini", dtype="float32")
    z = ops.sizes(cfg)
    assert z["expert"] == 3 * 512 * 128 and z["act"] == 4


def test_cpu_regimes_are_charged_at_their_measured_rates():
    s = toy(chips=1, copy_bytes_per_s=10 * GB, small_matmul_flops=1e12)
    c = ops.Cost(copy_bytes=20e6, small_mxu_flops=3e9)
    # memory: 20 MB at 10 GB/s = 2 ms; compute: 3 GFLOP at 1 TFLOP/s = 3 ms
    assert ops.seconds(c, s) == pytest.approx(3e-3)
    assert ops.seconds(ops.Cost(copy_bytes=8e9), toy(chips=1)) == pytest.approx(8e9 / (1e12 * 0.8))  # HBM rate


def test_few_rows_are_charged_at_their_measured_rate():
    """A dense dot with few rows runs at the rate measured at its rows (linear between measured rows, the nearest
    outside, never above the peak): its FLOPs stay its own, the peak FLOPs it idles through are charged beside them.
    The rate applies past the native handler's rows (decode rows stream through it); the MoE is priced as before."""
    table = ((32, 0.5), (64, 0.75), (256, 1.0))
    assert ops.row_efficiency(table, 48) == pytest.approx(0.625) and ops.row_efficiency(table, 8) == 0.5
    assert ops.row_efficiency(table, 4096) == ops.row_efficiency((), 64) == 1.0
    c = ops.few_rows(table, 64, 3e9)  # 3 GFLOP at 0.75 of the peak: 1 GFLOP's time idle
    assert c.extra_mxu_flops == pytest.approx(1e9) and c.flops == 0 and ops.few_rows(table, 512, 3e9) == ops.Cost()
    s = toy(chips=1)  # 100 TFLOP/s x 0.5
    assert ops.seconds(ops.Cost(mxu_flops=3e9) + c, s) == pytest.approx(4e9 / 50e12)
    cfg = get_config("qwen3.5-mini", dtype="float32")
    pl = ops.Pricing(dense_row_efficiency=table)
    for rows, slower in ((ops.NATIVE_DENSE_ROWS, False), (64, True)):
        b = ops.Batch(decodes=rows)
        plain = ops.gdn_block(cfg, b, ops.Pricing())["gdn_proj"]
        priced = ops.gdn_block(cfg, b, pl)["gdn_proj"]
        assert priced.flops == plain.flops and (priced.extra_mxu_flops > 0) == slower
    b = ops.Batch(decodes=64)
    routed = [moe_costs.moe_block(cfg, b, p)["routed_experts"] for p in (pl, ops.Pricing())]
    assert routed[0] == routed[1]  # the experts' matmuls are not dense projections


def test_items_attention_reads_its_groups_longest_context_once_per_item():
    """`items` (the CPU's paged attention): a step with a prefill reads its group's longest context once per item
    (blocks of ITEM_BLOCK tokens + the page table's S rows, as `paged_attention_items` computes them: 41 items in
    groups of WALK_ROWS by context, each to its own longest), not once per token (516 tokens, grouped so too); a
    decode step (ITEM_COST x items not fewer than tokens: the kernel runs the twin) costs what `xla` costs."""
    cfg = get_config("qwen3.5-mini", dtype="float32")
    items, xla = (ops.Pricing(attention=a, page_size=16) for a in ("items", "xla"))
    tok_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V of a token, float32
    mixed = ops.Batch(decodes=4, decode_ctx=256, prefill_tokens=512, prefill_seqs=1, max_ctx=512, padded_tokens=516,
                      logit_rows=8)
    n = ops.attention_items(mixed, 1)
    assert n == -(-516 // ops.ITEM_BLOCK) + 8 == 41
    g_tok, g_item = -(-516 // ops.WALK_ROWS), -(-41 // ops.WALK_ROWS)
    own_tok = (4 * 256 + 512 * (512 + 1) / 2) / 516  # the decodes' contexts and the prompt tokens' own positions
    own_item = (4 * 256 + 32 * (512 + ops.ITEM_BLOCK) / 2) / 41  # 4 decodes, 32 prompt items, 5 unused
    walk_tok, walk_item = (own + (512 - own) / g for own, g in ((own_tok, g_tok), (own_item, g_item)))
    assert ops.walked_context(mixed, 1, 516, 512, 1) == (g_tok, pytest.approx(walk_tok))
    assert ops.walked_context(mixed, 1, n, 32, ops.ITEM_BLOCK) == (g_item, pytest.approx(walk_item))
    # the rows padded to whole groups after the sort: the padding walks to the longest, 512
    tok, item = (ops.xla_walk(mixed, p) for p in (xla, items))
    assert (tok.items, tok.rows, tok.groups) == (False, g_tok * ops.WALK_ROWS, g_tok)
    assert tok.walk == pytest.approx((516 * walk_tok + (tok.rows - 516) * 512) / tok.rows)
    assert (item.items, item.rows, item.groups) == (True, g_item * ops.WALK_ROWS, g_item)
    assert item.walk == pytest.approx((n * walk_item + (item.rows - n) * 512) / item.rows)
    keys = -(-item.walk // 64) * 64  # a group's steps of ITEM_KEYS = 64 keys
    core = {p.attention: ops.attention_block(cfg, mixed, p)["attn_core"] for p in (items, xla)}
    assert core["items"].bytes - item.rows * keys * tok_bytes == pytest.approx(
        core["xla"].bytes - tok.rows * tok.walk * tok_bytes)
    assert core["items"].mxu_flops == pytest.approx(4 * cfg.head_dim * cfg.num_q_heads * item.rows * ops.ITEM_BLOCK
                                                    * keys)
    decode = ops.Batch(decodes=8, decode_ctx=300, max_ctx=300, padded_tokens=8, logit_rows=8)
    assert ops.attention_block(cfg, decode, items) == ops.attention_block(cfg, decode, xla)


def test_the_xla_walk_reads_each_groups_own_longest_context():
    """512 decodes at a mean context of 4,000 up to 9,000 on one rank: groups of WALK_ROWS sorted by context, each
    walking to its own longest, read 4,000 + 5,000 / groups keys a token on average; one group (as many tokens as a
    group holds) walks to the longest."""
    b = ops.Batch(decodes=512, decode_ctx=4000, max_ctx=9000)
    g = 512 // ops.WALK_ROWS
    assert ops.walked_context(b, 1, 512, 0, 1) == (g, 4000 + 5000 / g)
    assert ops.walked_context(b, g, ops.WALK_ROWS, 0, 1) == (1, 9000)
