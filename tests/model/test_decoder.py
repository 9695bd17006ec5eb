"""forward: padding, batching, input validation, the layer scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import forward, get_config, init_weights


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    return cfg, init_weights(cfg, 0)


def test_padded_rows_match_rows_alone(tiny):
    cfg, w = tiny
    rng = np.random.default_rng(0)
    lengths = [70, 1, 33]
    ids = rng.integers(0, cfg.vocab_size, (3, 70))
    batched = np.asarray(forward(cfg, w, ids, lengths))
    for b, n in enumerate(lengths):
        alone = np.asarray(forward(cfg, w, ids[b : b + 1, :n]))[0]
        np.testing.assert_allclose(batched[b, :n], alone, atol=2e-6)  # float32, same math, other shapes
    assert np.isfinite(batched).all()


def test_causal_prefix_logits_do_not_depend_on_later_tokens(tiny):
    cfg, w = tiny
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 80))
    other = ids.copy()
    other[0, 50:] = (other[0, 50:] + 1) % cfg.vocab_size
    a, b = np.asarray(forward(cfg, w, ids)), np.asarray(forward(cfg, w, other))
    np.testing.assert_allclose(a[0, :50], b[0, :50], atol=1e-6)
    assert np.abs(a[0, 50:] - b[0, 50:]).max() > 1e-3


def test_hidden_states_are_what_the_lm_head_reads(tiny):
    # model.decoder.forward's return_hidden: the same logits, and the last hidden states after the final norm
    # (the MTP head's input)
    from qwen35_lib.model import decoder

    cfg, w = tiny
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 37))
    lengths = np.array([37, 20])
    logits = np.asarray(forward(cfg, w, ids, lengths))
    with_hidden, hidden = decoder.forward(cfg, w, ids, lengths, return_hidden=True)
    assert hidden.shape == (2, 37, cfg.hidden_size) and hidden.dtype == jnp.dtype(cfg.dtype)
    np.testing.assert_array_equal(np.asarray(with_hidden), logits)
    h = np.asarray(hidden, np.float64)
    for b, n in enumerate(lengths):  # the LM head on the hidden states gives the logits
        np.testing.assert_allclose(h[b, :n] @ np.asarray(w["lm_head"], np.float64), logits[b, :n], atol=1e-5)
    # after the final norm: x / sqrt(mean(x^2) + eps) * (1 + final_norm), so h / (1 + final_norm) has an RMS just
    # under 1 (eps 1e-6 against the random model's mean(x^2) of a few 1e-4)
    rms = np.sqrt(np.mean((h / (1.0 + np.asarray(w["final_norm"], np.float64))) ** 2, axis=-1))
    assert (rms <= 1.0).all() and (rms > 0.99).all(), rms


def test_layers_run_as_one_scan(tiny):
    # The decoder is a scan over layer groups: the lowered program has one loop, not one copy per layer.
    cfg, w = tiny
    from qwen35_lib.model.decoder import forward_prepared
    from qwen35_lib.model.parallelism import LOCAL

    deep = cfg.replace(num_layers=12)
    wd = jax.eval_shape(lambda: init_weights(deep, 0))
    ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    text = forward_prepared.lower(deep, LOCAL, wd, ids, jax.ShapeDtypeStruct((1,), jnp.int32)).as_text()
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    shallow = forward_prepared.lower(cfg, LOCAL, jax.eval_shape(lambda: w), ids, lengths).as_text()
    assert text.count("stablehlo.while") == shallow.count("stablehlo.while") >= 1
    assert abs(len(text) - len(shallow)) < 0.05 * len(shallow)


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (np.array([[1.0, 2.0]]), TypeError, "integer array"),
        (np.array([1, 2, 3]), ValueError, r"\[batch, seq\].*token_ids\[None\]"),
        (np.array([[1, 256]]), ValueError, r"token id 256 is outside the vocabulary \[0, 256\)"),
        (np.array([[-1, 2]]), ValueError, "token id -1 is outside"),
        (np.zeros((1, 0), np.int32), ValueError, "no tokens"),
    ],
)
def test_bad_token_ids_are_named(tiny, ids, error, match):
    cfg, w = tiny
    with pytest.raises(error, match=match):
        forward(cfg, w, ids)


def test_bad_lengths_and_weights_are_named(tiny):
    cfg, w = tiny
    ids = np.ones((2, 5), np.int32)
    with pytest.raises(ValueError, match=r"each length must be in \[1, 5\]"):
        forward(cfg, w, ids, [5, 6])
    with pytest.raises(ValueError, match="lengths must be 2 integers"):
        forward(cfg, w, ids, [5])
    with pytest.raises(ValueError, match=r"\['embed'\] is float32\[256, 64\] but config .* declares float32\[512"):
        forward(cfg.replace(vocab_size=512), w, ids)
    with pytest.raises(ValueError, match="missing .*lm_head"):
        forward(cfg, {k: v for k, v in w.items() if k != "lm_head"}, ids)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        get_config("qwen3.5-tiny", num_q_heads=3)
    with pytest.raises(ValueError, match="unknown model 'qwen9'"):
        get_config("qwen9")
