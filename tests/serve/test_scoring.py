"""serve.scoring against its reference: the log-softmax of `forward`'s logits over the whole sequence."""

import numpy as np

from qwen35_lib import forward
from qwen35_lib.engine import Engine, EngineConfig
from qwen35_lib.serve import scoring


def test_scores_are_the_forward_log_softmax_with_ranks_and_top_k(tiny):
    cfg, w = tiny
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 37).tolist()  # padded to the 64-token bucket
    s = scoring.Scorer(Engine(cfg, w, EngineConfig(max_model_len=128)), k=5).score(ids)
    logits = np.asarray(forward(cfg, w, np.array([ids])))[0, :-1].astype(np.float64)  # [36, V]
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    want = lp[np.arange(36), ids[1:]]
    np.testing.assert_allclose(s.token, want, atol=1e-4)
    np.testing.assert_array_equal(s.rank, 1 + (lp > want[:, None] + 1e-6).sum(-1))
    np.testing.assert_allclose(s.top_lp, -np.sort(-lp, axis=-1)[:, :5], atol=1e-4)
    np.testing.assert_allclose(np.take_along_axis(lp, s.top_ids, -1), s.top_lp, atol=1e-4)  # the ids of those


def test_a_sequence_of_one_token_has_no_scores(tiny):
    cfg, w = tiny
    s = scoring.Scorer(Engine(cfg, w, EngineConfig(max_model_len=64)), k=3).score([5])
    assert s.token.shape == (0,) and s.top_ids.shape == (0, 3)
    assert scoring.token_text(None, 7) == "token_id:7"
