"""bench.roofline: the step's component floors agree with the decode bytes."""

import pytest

from qwen35_lib import get_config
from qwen35_lib.bench.roofline import component_floors, decode_bytes, step_components


def test_step_components_agree_with_the_decode_bytes():
    cfg = get_config("qwen3.5-mini", dtype="float32")
    contexts = [100, 37, 64, 5]
    parts = step_components(cfg, [1] * 4, contexts, head_rows=4)
    old = decode_bytes(cfg, contexts)
    assert parts["MoE"]["bytes"] == pytest.approx(old["experts"])
    assert parts["attention"]["bytes"] == old["kv_cache"] and parts["GDN"]["bytes"] == old["gdn_state"]
    assert parts["dense matmuls"]["bytes"] < old["dense_weights"]  # the norms, convs, gates are not matmuls
    # a prefill of T tokens: causal attention sees T(T+1)/2 keys per head; FLOPs scale with the tokens
    T = 128
    pre = step_components(cfg, [T], [T], head_rows=T)
    assert pre["attention"]["flops"] == 4 * cfg.num_q_heads * cfg.head_dim * T * (T + 1) / 2 * 2  # 2 attention layers
    assert pre["MoE"]["flops"] == pytest.approx(T * parts["MoE"]["flops"] / 4)
    assert step_components(cfg, [0, 1], [0, 9], 1)["GDN"] == step_components(cfg, [1], [9], 1)["GDN"]  # padding
    floors = component_floors(parts, bandwidth=1e10, peak=1e11)
    assert floors["MoE"]["bytes_ms"] == pytest.approx(1e3 * parts["MoE"]["bytes"] / 1e10)
