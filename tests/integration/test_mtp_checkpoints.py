"""Speculation on the other test checkpoint: a Qwen3-Next model (`qwen3_next`) with its MTP head, stored per expert
(the head's experts per expert too), read back and served with drafts. Its greedy output, batched with preemption,
is the output without drafts (test_speculative.py checks the Qwen3.5 checkpoint at k = 1, 2, 3 and under
the layouts; here k = 2, the head's other config and storage)."""

import numpy as np
import pytest

from qwen35_lib import testing
from qwen35_lib.checkpoint import load_hf_checkpoint, load_mtp
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams

EC = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=64, num_pages=9)  # preemptions
PARAMS = [SamplingParams(max_new_tokens=n) for n in (14, 9, 20, 12)]  # 17 pages of 8 in all


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("transformers")
    hf = testing.make_hf_model("qwen3_next")
    path = testing.save_hf_checkpoint(hf, tmp_path_factory.mktemp("next") / "ckpt", "per_expert", mtp=True)
    cfg, w = load_hf_checkpoint(path, eos_token_ids=())
    cfg_head, head = load_mtp(path, eos_token_ids=())
    assert cfg_head == cfg and cfg.model_type == "qwen3_next"
    return cfg, w, head


def test_qwen3_next_greedy_output_is_the_same_with_drafts_verified(model):
    cfg, w, head = model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (21, 1, 30, 7)]
    plain = Engine(cfg, w, EngineConfig(**EC))
    reference = [r.output_ids for r in plain.generate(prompts, PARAMS)]  # batched = alone: test_engine's
    engine = Engine(cfg, w, EngineConfig(**EC, speculative_tokens=2), mtp_weights=head)
    assert [r.output_ids for r in engine.generate(prompts, PARAMS)] == reference
    assert engine.preemptions > 0 and engine.stats.drafted > 0
