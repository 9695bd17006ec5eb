"""model_stats: parameter and byte counts of qwen3.5-tiny, checked against its weights and hand-worked sizes."""

from __future__ import annotations

import jax
import numpy as np

from qwen35_lib import get_config
from qwen35_lib.stats import model_stats


def test_total_parameters_are_the_weights_elements(tiny):
    cfg, w = tiny
    st = model_stats(cfg)
    assert st.total_params == sum(np.size(x) for x in jax.tree.leaves(w))
    assert st.total_params == sum(st.params_by_part.values())
    assert set(st.params_by_part) == {"embed", "lm_head", "attention", "gdn", "router", "routed_experts",
                                      "shared_experts", "norms"}
    # float32: 4 bytes a parameter, all in one dtype
    assert st.weight_bytes == 4 * st.total_params and st.weight_bytes_by_dtype == {"float32": st.weight_bytes}
    assert st.as_dict()["total_params"] == st.total_params


def test_parts_and_active_parameters_by_hand(tiny):
    cfg, _ = tiny  # D=64, V=256, E=8 experts of F=32 (top 3), shared F=48, 4 layers: 3 GDN + 1 attention
    st = model_stats(cfg)
    parts = st.params_by_part
    assert parts["embed"] == parts["lm_head"] == 256 * 64
    assert parts["routed_experts"] == 4 * 8 * (64 * 2 * 32 + 32 * 64)
    assert parts["router"] == 4 * 64 * 8
    assert parts["shared_experts"] == 4 * (64 * 2 * 48 + 48 * 64 + 64)  # gate_up, down, shared gate
    assert parts["attention"] == 1 * (64 * 4 * 32 * 2 + 64 * 2 * 32 * 2 + 4 * 32 * 64)  # q, gate; k, v; o
    routed = parts["routed_experts"]
    assert st.active_params == st.total_params - routed + routed * 3 // 8


def test_cache_sizes_by_hand(tiny):
    cfg, _ = tiny  # 1 attention layer, 2 KV heads of 32; 3 GDN layers of 4 v-heads of 16 x 24; conv 4 taps
    st = model_stats(cfg)
    assert st.kv_bytes_per_token == 2 * 1 * 2 * 32 * 4  # K and V, float32
    assert model_stats(cfg, kv_dtype="bfloat16").kv_bytes_per_token == 2 * 1 * 2 * 32 * 2
    assert st.gdn_recurrent_bytes_per_seq == 3 * 4 * 16 * 24 * 4  # float32 state
    conv_dim = 2 * 2 * 16 + 4 * 24  # [q | k | v] channels
    assert st.gdn_conv_bytes_per_seq == 3 * conv_dim * (4 - 1) * 4
    assert st.gdn_state_bytes_per_seq == st.gdn_recurrent_bytes_per_seq + st.gdn_conv_bytes_per_seq


def test_fp8_experts_count_scales_as_bytes_not_parameters():
    bf16 = get_config("qwen3.5-tiny")
    fp8 = get_config("qwen3.5-tiny", expert_dtype="float8_e4m3fn", fp8_block_size=16)
    a, b = model_stats(bf16), model_stats(fp8)
    assert a.params_by_part == b.params_by_part
    routed = a.params_by_part["routed_experts"]
    # per layer: gate_up scales [8, 64/16, 2, 32/16], down scales [8, 32/16, 64/16], float32
    scales = 4 * 8 * (4 * 2 * 2 + 2 * 4) * 4
    assert b.weight_bytes_by_dtype["float8_e4m3fn"] == routed
    assert b.weight_bytes == a.weight_bytes - 2 * routed + routed + scales


def test_mtp_head_is_counted_apart_from_the_model(tiny):
    from qwen35_lib.stats import mtp_stats
    from qwen35_lib.weights import init_mtp_weights

    cfg, w = tiny  # D=64, E=8 experts of F=32 (top 3), shared F=48; the head: fc, 3 norms, one attention layer
    head = mtp_stats(cfg)
    assert head.total_params == sum(np.size(x) for x in jax.tree.leaves(init_mtp_weights(cfg, 0)))
    parts = head.params_by_part
    # no embed or lm_head: the main model's, which the head shares, counted there only
    assert set(parts) == {"fc", "attention", "router", "routed_experts", "shared_experts", "norms"}
    assert parts["fc"] == 2 * 64 * 64
    assert parts["norms"] == 3 * 64 + 2 * 64 + 2 * 32  # pre-fc x2, final; input, post; q_norm, k_norm
    assert parts["attention"] == 64 * 4 * 32 * 2 + 64 * 2 * 32 * 2 + 4 * 32 * 64
    assert parts["routed_experts"] == 8 * (64 * 2 * 32 + 32 * 64)
    assert head.active_params == head.total_params - parts["routed_experts"] * (8 - 3) // 8
    assert (head.kv_bytes_per_token, head.gdn_state_bytes_per_seq) == (2 * 2 * 32 * 4, 0)  # its one attention layer
    # the main model's counts (what the cost model prices) do not include it
    assert model_stats(cfg).total_params == sum(np.size(x) for x in jax.tree.leaves(w))
