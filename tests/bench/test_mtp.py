"""`bench mtp`: acceptance counted by hand; drafts placed and chained right (a stand-in head that copies the
verifier is always accepted, one always off by one never; the real head's chain against running it row by row);
distillation on qwen3.5-tiny lowers the head's loss and raises its acceptance above the random head's; the document."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.bench import mtp
from qwen35_lib.model.mtp import mtp_forward
from qwen35_lib.weights import init_mtp_weights

# the distillation case, `--quick`'s: 48 prompts of 16 tokens + 8 greedy to train on, 8 held out (shared here)
SIZES = {k: mtp.QUICK[k] for k in ("train_prompts", "eval_prompts", "prompt_len", "new_tokens")}


def test_acceptance_by_hand():
    targets = np.array([[1, 2, 3]] * 4)
    drafts = np.array([[1, 2, 3], [1, 2, 9], [1, 9, 3], [9, 2, 3]])  # all, 2, 1 and 0 accepted
    a = mtp.acceptance(drafts, targets)
    assert a["origins"] == 4
    np.testing.assert_allclose(a["per_position"], [0.75, 0.5, 0.25])
    np.testing.assert_allclose(a["conditional"], [0.75, 2 / 3, 0.5])
    np.testing.assert_allclose([a["acceptance_length"][k] for k in "123"], [1.75, 2.25, 2.5])
    right = mtp.acceptance(targets, targets)
    assert right["per_position"] == [1.0] * 3 and right["acceptance_length"] == {"1": 2.0, "2": 3.0, "3": 4.0}
    wrong = mtp.acceptance(targets + 1, targets)
    assert wrong["per_position"] == [0.0] * 3 and wrong["conditional"] == [0.0, None, None]
    assert wrong["acceptance_length"] == {"1": 1.0, "2": 1.0, "3": 1.0}
    with pytest.raises(ValueError, match="same"):
        mtp.acceptance(drafts[:, :2], targets)


def _counting_sequences(V=50, N=3, P=4, G=7, D=4):
    """Continuations where the verifier's greedy token after x is x + 1 (mod V): ids count up from the prompt."""
    rng = np.random.default_rng(0)
    ids = (rng.integers(0, V, (N, 1)) + np.arange(P + G)) % V
    return mtp.Sequences(ids.astype(np.int32), rng.standard_normal((N, P + G, D)).astype(np.float32),
                         ((ids + 1) % V).astype(np.int32), P)


@pytest.mark.parametrize("step, accepted", [(1, 1.0), (2, 0.0)])
def test_drafts_are_placed_and_chained_as_the_verifier_reads_them(monkeypatch, step, accepted):
    # A stand-in head drafting `next_id + step`: with step 1 it copies the verifier's greedy token (every draft,
    # chained on its own drafts, accepted: origins, chain inputs and targets line up); with 2 it is always wrong.
    seqs, V = _counting_sequences(), 50

    def head(config, weights, mtp_weights, hidden, next_ids, lengths=None, parallelism=None):
        B, T = next_ids.shape
        assert (np.asarray(lengths) <= T).all() if lengths is not None else True
        return jnp.asarray(hidden), jnp.asarray(np.eye(V, dtype=np.float32)[(np.asarray(next_ids) + step) % V])

    monkeypatch.setattr(mtp, "mtp_forward", head)
    shared = {"embed": None, "lm_head": None}
    where = mtp.origins(seqs, 3)
    assert where[:5] == [(0, 3), (0, 4), (0, 5), (0, 6), (0, 7)] and len(where) == 3 * 5  # t from P - 1 to L - k - 1
    drafts = mtp.draft_chain(None, shared, {}, seqs, where, 3, batch=4)
    r, t = where[-1]
    assert drafts[-1].tolist() == [(seqs.ids[r, t + 1] + step * j) % V for j in (1, 2, 3)]
    result = mtp.evaluate(None, shared, {}, seqs, 3)
    assert result["per_position"] == [accepted] * 3
    assert result["acceptance_length"]["3"] == 1 + 3 * accepted


@pytest.fixture(scope="module")
def data(tiny):
    cfg, w = tiny
    prompts = mtp.synthetic_prompts(SIZES["train_prompts"] + SIZES["eval_prompts"], SIZES["prompt_len"],
                                    cfg.vocab_size, 0)
    train = mtp.greedy_sequences(cfg, w, prompts[:SIZES["train_prompts"]], SIZES["new_tokens"])
    held = mtp.greedy_sequences(cfg, w, prompts[SIZES["train_prompts"]:], SIZES["new_tokens"])
    return train, held


def test_greedy_sequences_are_the_models_greedy_continuations(tiny, data):
    cfg, w = tiny
    train, _ = data
    P = SIZES["prompt_len"]
    assert train.ids.shape == (48, 24) and train.hidden.shape == (48, 24, cfg.hidden_size)
    assert train.mismatches == 0  # each token the argmax of the teacher-forced logits before it
    np.testing.assert_array_equal(train.ids[:, P:], train.greedy[:, P - 1:-1])


def test_the_chain_is_the_head_run_row_by_row(tiny, data):
    # draft 2 of an origin: the head on the true prefix, then on the prefix + (its own state, draft 1)
    cfg, w = tiny
    _, held = data
    head = init_mtp_weights(cfg, 1)
    where = mtp.origins(held, 2)[::7]
    drafts = mtp.draft_chain(cfg, w, head, held, where, 2, batch=4)
    for (r, t), got in zip(where, drafts):
        h, x = held.hidden[r, :t + 1], held.ids[r, 1:t + 2]
        out, logits = mtp_forward(cfg, w, head, h[None], x[None], parallelism=mtp.HEAD)
        d1 = int(jnp.argmax(logits[0, -1]))
        h2, x2 = np.concatenate([h, np.asarray(out[0, -1:])]), np.concatenate([x, [d1]])
        _, logits2 = mtp_forward(cfg, w, head, h2[None], x2[None], parallelism=mtp.HEAD)
        assert got.tolist() == [d1, int(jnp.argmax(logits2[0, -1]))], (r, t)


def test_distillation_lowers_the_loss_and_raises_acceptance(tiny, data):
    cfg, w = tiny
    train, held = data
    head = init_mtp_weights(cfg, 1)
    before = mtp.evaluate(cfg, w, head, held, 3)
    trained, losses = mtp.distill(cfg, w, head, train, 40, lr=3e-3, batch=16, seed=0)
    after = mtp.evaluate(cfg, w, trained, held, 3)
    assert len(losses) == 40 and np.mean(losses[-5:]) < np.mean(losses[:5])
    assert after["loss"] < before["loss"]
    assert after["per_position"][0] > before["per_position"][0] + 0.05, (before, after)
    assert after["acceptance_length"]["3"] > before["acceptance_length"]["3"]
    np.testing.assert_array_equal(head["fc"], init_mtp_weights(cfg, 1)["fc"])  # the head given is not changed


def test_run_reports_before_and_after(tiny, monkeypatch, capsys):
    cfg, w = tiny
    monkeypatch.setattr(mtp, "build", lambda args, model: (cfg, w, init_mtp_weights(cfg, 1), "random"))
    p = argparse.ArgumentParser()
    mtp.add_arguments(p)
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    args = p.parse_args(["--distill", "2", "--batch", "16", "--no-engine", *sizes])
    doc = mtp.run(args)
    assert doc["benchmark"] == "mtp" and doc["distill"]["steps"] == 2 and len(doc["distill"]["losses"]) == 2
    assert set(doc["before"]["acceptance_length"]) == {"1", "2", "3"} and doc["after"]["origins"] == 8 * 6
    assert doc["engine_speculation"] == {"measured": False, "reason": "--no-engine"}
    assert "distilled (2 steps)" in capsys.readouterr().out


def test_options_are_checked():
    p = argparse.ArgumentParser()
    mtp.add_arguments(p)
    with pytest.raises(ValueError, match="continuation longer than k"):
        mtp._resolve(p.parse_args(["--k", "3", "--new-tokens", "3"]))
    with pytest.raises(ValueError, match="at least"):
        mtp._resolve(p.parse_args(["--distill", "-1"]))
    assert mtp._resolve(p.parse_args(["--quick"]))["model"] == "qwen3.5-tiny"


def test_a_checkpoint_brings_its_head(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from qwen35_lib import testing
    from qwen35_lib.checkpoint import load_mtp

    model = testing.make_hf_model()
    p = argparse.ArgumentParser()
    mtp.add_arguments(p)
    with_head = testing.save_hf_checkpoint(model, tmp_path / "with", "fused", mtp=True)
    cfg, w, head, source = mtp.build(p.parse_args(["--checkpoint", str(with_head)]), "unused")
    assert source == "checkpoint" and cfg.dtype == "float32" and "embed" in w
    np.testing.assert_array_equal(head["fc"], load_mtp(with_head)[1]["fc"])
    without = testing.save_hf_checkpoint(model, tmp_path / "without", "fused", mtp=False)
    *_, source = mtp.build(p.parse_args(["--checkpoint", str(without)]), "unused")
    assert source == "random" and "a random head instead" in capsys.readouterr().err


def test_the_structured_base_ties_its_lm_head_to_a_permuted_embedding(tiny):
    cfg, w = tiny
    s = mtp.structured_base(w, 0.5, seed=3)
    perm = np.random.default_rng(3).permutation(cfg.vocab_size)
    unit = w["embed"] / jnp.linalg.norm(w["embed"], axis=-1, keepdims=True)
    logits = unit @ s["lm_head"]  # [V, V]: a token's own direction scores highest at pi(token)
    assert (np.asarray(jnp.argmax(logits, axis=-1)) == perm).all()
    np.testing.assert_allclose(s["layers"]["moe"]["w_down"], w["layers"]["moe"]["w_down"] * 0.5)
    np.testing.assert_array_equal(s["layers"]["moe"]["router"], w["layers"]["moe"]["router"])
    assert jax.tree.structure(s) == jax.tree.structure(w)
