"""The gated attention layer of qwen3.5-tiny: projections and norms against NumPy, RoPE leaving the rest of a head
alone, the first token attending to itself only, causality, right padding, and the paged (ragged) block giving
the dense block's outputs."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.model.attention import attention_block, attention_ragged_block, output, qkv
from qwen35_lib.model.parallelism import LOCAL

T = 6


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + w)


@pytest.fixture(scope="module")
def layer(tiny):
    cfg, w = tiny
    aw = jax.tree.map(lambda a: np.asarray(a[0, 0]), w["layers"]["attn"])
    x = np.random.default_rng(0).standard_normal((2, T, cfg.hidden_size)).astype(np.float32)
    return cfg, aw, x


def test_projections_norms_and_rope(layer):
    cfg, w, x = layer
    zero = jnp.zeros((2, T), jnp.int32)
    q, gate, k, v = map(np.asarray, qkv(cfg, w, x, zero))  # position 0: RoPE turns by angle 0
    eps = cfg.rms_norm_eps
    np.testing.assert_allclose(q, _rms(np.einsum("btd,dhe->bthe", x, w["w_q"]), w["q_norm"], eps), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(k, _rms(np.einsum("btd,dhe->bthe", x, w["w_k"]), w["k_norm"], eps), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(gate, np.einsum("btd,dhe->bthe", x, w["w_gate"]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(v, np.einsum("btd,dhe->bthe", x, w["w_v"]), rtol=1e-4, atol=1e-6)
    q5, _, k5, _ = map(np.asarray, qkv(cfg, w, x, zero + 5))
    rd = cfg.rotary_dim  # 8 of 32 dims turn; the rest pass through; each turned pair keeps its length
    assert 0 < rd < cfg.head_dim
    np.testing.assert_allclose(q5[..., rd:], q[..., rd:], rtol=1e-6)
    assert np.abs(q5[..., :rd] - q[..., :rd]).max() > 1e-2
    pair = lambda a: a[..., :rd // 2] ** 2 + a[..., rd // 2:rd] ** 2  # noqa: E731
    np.testing.assert_allclose(pair(k5), pair(k), rtol=1e-4, atol=1e-6)


def test_output_gates_then_projects(layer):
    cfg, w, _ = layer
    rng = np.random.default_rng(1)
    o, gate = (rng.standard_normal((1, 2, cfg.num_q_heads, cfg.head_dim)).astype(np.float32) for _ in range(2))
    want = np.einsum("bthe,hed->btd", o / (1 + np.exp(-gate)), w["w_o"])
    np.testing.assert_allclose(output(w, o, gate), want, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def dense(layer):
    cfg, w, x = layer
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    block = jax.jit(lambda x, lengths: attention_block(cfg, w, x, pos, lengths))
    return block


def test_first_token_sees_only_itself_and_later_tokens_never_reach_back(layer, dense):
    cfg, w, x = layer
    full = np.asarray(dense(x, jnp.array([T, T])))
    pos = jnp.zeros((2, T), jnp.int32)
    q, gate, k, v = qkv(cfg, w, x, pos)
    own = np.asarray(output(w, jnp.repeat(v, cfg.num_q_heads // cfg.num_kv_heads, axis=2), gate))
    np.testing.assert_allclose(full[:, 0], own[:, 0], rtol=1e-4, atol=1e-6)
    x2 = x.copy()
    x2[:, 3] += 1.0
    moved = np.asarray(dense(x2, jnp.array([T, T])))
    np.testing.assert_array_equal(moved[:, :3], full[:, :3])
    assert (np.abs(moved[:, 3:] - full[:, 3:]).max(axis=-1) > 1e-4).all()


def test_right_padding_is_not_attended(layer, dense):
    _, _, x = layer
    full = np.asarray(dense(x, jnp.array([T, T])))
    x2 = x.copy()
    x2[1, 4:] = 7.0  # padding of row 1 (length 4)
    padded = np.asarray(dense(x2, jnp.array([T, 4])))
    np.testing.assert_allclose(padded[1, :4], full[1, :4], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(padded[0], full[0])


def test_ragged_block_over_pages_is_the_dense_block(layer, dense):
    """Both rows as one rank's ragged batch (row 0's 6 tokens, row 1's first 4, 2 padding slots), pages of 4."""
    cfg, w, x = layer
    want = np.asarray(dense(x, jnp.array([T, 4])))
    seq = np.array([0] * T + [1] * 4 + [-1] * 2)
    pos = np.array(list(range(T)) + list(range(4)) + [0, 0])
    xs = np.concatenate([x[0], x[1, :4], np.zeros((2, cfg.hidden_size), np.float32)])
    meta = types.SimpleNamespace(positions=jnp.asarray(pos)[None], token_seq=jnp.asarray(seq)[None],
                                 page_table=jnp.array([[[3, 1], [2, 0]]]))
    kv = jnp.zeros((1, 4, 4, 2 * cfg.num_kv_heads * cfg.head_dim))
    out, kv, scales = jax.jit(lambda x, kv: attention_ragged_block(cfg, w, x, meta, kv, None, LOCAL))(xs[None], kv)
    assert scales is None
    out = np.asarray(out[0])
    np.testing.assert_allclose(out[:T], want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[T:T + 4], want[1, :4], rtol=1e-4, atol=1e-5)
    written = np.abs(np.asarray(kv[0])).sum(-1) > 0  # [page, slot]: row 0 in pages 3, 1; row 1 in page 2
    np.testing.assert_array_equal(written, [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
