"""The Gated DeltaNet layer of qwen3.5-tiny: the causal conv against NumPy, a row split in two steps giving the
one-step outputs (conv history and state carried), right padding leaving the state alone, and the ragged layer
(flat tokens, slot pools) giving the dense layer's outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.engine.batch import SeqWork, pack
from qwen35_lib.model import deltanet
from qwen35_lib.model.deltanet import causal_conv, conv_groups, gdn_block, gdn_ragged_block, ragged_conv
from qwen35_lib.model.parallelism import LOCAL
from qwen35_lib.plan import SINGLE, get_layout

RNG = np.random.default_rng(0)


def _silu(y):
    return y / (1 + np.exp(-y))


def test_causal_conv_is_numpys_and_continues_from_its_history():
    K, T = 4, 6
    x = RNG.standard_normal((2, T, 3, 5)).astype(np.float32)
    taps = RNG.standard_normal((K, 3, 5)).astype(np.float32)
    hist = RNG.standard_normal((2, K - 1, 3, 5)).astype(np.float32)
    y, new = causal_conv(x, taps, hist)
    xp = np.concatenate([hist, x], axis=1)
    want = _silu(sum(xp[:, j:j + T] * taps[j] for j in range(K)))  # taps[K-1] on the token itself
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new, x[:, -(K - 1):])
    y1, h1 = causal_conv(x[:, :2], taps, hist)  # 2 tokens, then the other 4 from the history they leave
    y2, _ = causal_conv(x[:, 2:], taps, h1)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), y, rtol=1e-6, atol=1e-7)


def test_ragged_conv_gives_each_sequence_the_dense_conv():
    """Sequence 0 decodes one token after 3 earlier ones (history in slot 2); sequence 1 is a fresh 5-token
    prompt in slot 1, whose slot holds stale inputs that must not be read; sequence 2 continues with 2 tokens after
    5 (slot 3): its first token reads three history rows, its second two, and its new history keeps one of them."""
    K, H, d = 4, 2, 3
    taps = RNG.standard_normal((K, H, d)).astype(np.float32)
    a = RNG.standard_normal((4, H, d)).astype(np.float32)  # sequence 0's 4 inputs
    b = RNG.standard_normal((5, H, d)).astype(np.float32)
    c = RNG.standard_normal((7, H, d)).astype(np.float32)
    _, meta = pack([SeqWork([0], 3, [1], 2)], [SeqWork([0] * 5, 0, [2], 1), SeqWork([0] * 2, 5, [3], 3)], D=2, T=18,
                   S=3, max_pages=1, chunk=8)
    starts = np.asarray(meta.q_start)
    x = np.zeros((18, H, d), np.float32)
    x[starts[0]], x[starts[1]:starts[1] + 5], x[starts[2]:starts[2] + 2] = a[3], b, c[5:]
    hist = np.zeros((4, K - 1, H, d), np.float32)
    hist[2], hist[1], hist[3] = a[:3], 9.0, c[2:5]
    meta = jax.tree.map(jnp.asarray, meta)
    y, new = jax.jit(ragged_conv)(jnp.asarray(x), taps, jnp.asarray(hist), meta)
    zeros = np.zeros((1, K - 1, H, d), np.float32)
    want = [causal_conv(s[None], taps, zeros)[0][0] for s in (a, b, c)]
    np.testing.assert_allclose(y[starts[0]], want[0][3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[starts[1]:starts[1] + 5], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[starts[2]:starts[2] + 2], want[2][5:], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new[2], a[1:])  # each slot keeps its sequence's last K - 1 inputs
    np.testing.assert_array_equal(new[1], b[2:])
    np.testing.assert_array_equal(new[3], c[4:])
    np.testing.assert_array_equal(new[0], hist[0])  # the null slot takes what sequences without tokens write


def test_a_decode_only_step_takes_the_short_path_and_agrees_with_the_ragged_one_bit_for_bit():
    """Three decodes in a bucket of four (one padding token), six sequence rows: the decode path's outputs and pool
    are the general path's exactly, and each output is the dense conv of the sequence's inputs."""
    K, H, d = 4, 2, 3
    taps = RNG.standard_normal((K, H, d)).astype(np.float32)
    seqs = RNG.standard_normal((3, 6, H, d)).astype(np.float32)  # each sequence's 6 inputs, the last one new
    _, meta = pack([SeqWork([0], 5, [1], s + 1) for s in range(3)], [], D=4, T=4, S=6, max_pages=1, chunk=8)
    x = np.zeros((4, H, d), np.float32)
    x[:3] = seqs[:, 5]
    hist = np.full((5, K - 1, H, d), 7.0, np.float32)
    hist[1:4] = seqs[:, 2:5]
    meta = jax.tree.map(jnp.asarray, meta)
    y, new = jax.jit(ragged_conv)(jnp.asarray(x), taps, jnp.asarray(hist), meta)
    y_r, new_r = jax.jit(deltanet._ragged_conv)(jnp.asarray(x), taps, jnp.asarray(hist), meta)
    np.testing.assert_array_equal(y[:3], y_r[:3])
    np.testing.assert_array_equal(new[1:], new_r[1:])  # slot 0 is the null slot both write
    want, _ = causal_conv(seqs, taps, np.zeros((3, K - 1, H, d), np.float32))
    np.testing.assert_allclose(y[:3], want[:, 5], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new[1:4], seqs[:, 3:])
    np.testing.assert_array_equal(new[4], hist[4])  # an idle slot is left alone


@pytest.fixture(scope="module")
def layer(tiny):
    cfg, w = tiny
    cfg = cfg.replace(gdn_chunk_size=8)
    gw = jax.tree.map(lambda a: a[0, 0], w["layers"]["gdn"])
    x = RNG.standard_normal((2, 7, cfg.hidden_size)).astype(np.float32)
    block = jax.jit(lambda x, valid, hist, state: gdn_block(cfg, gw, x, valid, hist, state))
    return cfg, gw, x, block


def test_two_steps_are_one_and_padding_leaves_the_state(layer):
    cfg, _, x, block = layer
    full, hist, state = block(x, jnp.ones((2, 7), bool), None, None)
    o1, h1, s1 = block(x[:, :4], jnp.ones((2, 4), bool), None, None)
    o2, h2, s2 = block(x[:, 4:], jnp.ones((2, 3), bool), h1, s1)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), full, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s2, state, rtol=1e-4, atol=1e-6)
    assert state.dtype == jnp.float32 and state.shape == (2, 4, 16, 24)
    # row 0 padded after 4 tokens (junk there): its first 4 outputs and its state are the 4-token step's
    xp = x.copy()
    xp[0, 4:] = 5.0
    valid = jnp.asarray(np.arange(7)[None] < np.array([[4], [7]]))
    padded, _, sp = block(xp, valid, None, None)
    np.testing.assert_allclose(padded[0, :4], o1[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sp[0], s1[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sp[1], state[1], rtol=1e-4, atol=1e-6)


def test_v_joined_to_q_and_k_or_apart_is_the_same_layer(layer):
    """`conv_groups`: one causal conv over q, k and v where the plan keeps the v heads whole, q and k then v where it
    splits them over devices (tensor parallelism): the same outputs, conv history and state."""
    cfg, gw, x, _ = layer
    tp = get_layout("tp8_kvrep")
    assert conv_groups(SINGLE) == ("qkv",) and conv_groups(tp) == ("qk", "v")
    hist = {n: RNG.standard_normal((2, 3, *gw[f"conv_{n}"].shape[1:])).astype(np.float32) for n in "qkv"}
    valid = jnp.ones((2, 7), bool)
    joined = jax.jit(lambda x, h: gdn_block(cfg, gw, x, valid, h, plan=SINGLE))(x, hist)
    apart = jax.jit(lambda x, h: gdn_block(cfg, gw, x, valid, h, plan=tp))(x, hist)
    assert jax.tree.structure(joined) == jax.tree.structure(apart)
    for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(apart)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ragged_layer_is_the_dense_layer(layer):
    """Row 0 decodes its 5th token from slot 2 (conv history and state from the 4-token dense step); row 1's 7
    tokens are a fresh prefill in slot 1; one rank, chunks of 8."""
    cfg, gw, x, block = layer
    full, _, state = block(x, jnp.ones((2, 7), bool), None, None)
    _, h4, s4 = block(x[:, :4], jnp.ones((2, 4), bool), None, None)
    _, meta = pack([SeqWork([0], 4, [1], 2)], [SeqWork([0] * 7, 0, [2], 1)], D=2, T=10, S=2, max_pages=1, chunk=8)
    xr = np.zeros((1, 10, cfg.hidden_size), np.float32)
    xr[0, 0], xr[0, 2:9] = x[0, 4], x[1]
    cache = {f"conv_{n}": jnp.zeros((1, 3, *h4[n].shape[1:])).at[0, 2].set(h4[n][0]) for n in "qkv"}
    cache["state"] = jnp.zeros((1, 3, *s4.shape[1:])).at[0, 2].set(s4[0])
    meta = jax.tree.map(lambda a: jnp.asarray(a)[None], meta)
    out, new = jax.jit(lambda x, cache: gdn_ragged_block(cfg, gw, x, meta, cache, LOCAL))(jnp.asarray(xr), cache)
    np.testing.assert_allclose(out[0, 0], full[0, 4], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[0, 2:9], full[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new["state"][0, 1], state[1], rtol=1e-4, atol=1e-6)
    _, _, s5 = block(x, jnp.asarray(np.arange(7) < 5)[None].repeat(2, 0), None, None)  # rows padded after 5
    np.testing.assert_allclose(new["state"][0, 2], s5[0], rtol=1e-4, atol=1e-6)
