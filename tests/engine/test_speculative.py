"""engine.speculative: greedy output with drafts verified is the output without them (random heads: acceptance ~0,
so every step verifies and rolls back; an oracle drafter: multi-token acceptance), alone, batched with preemption
and under dp_ep; the acceptance rule by hand; the refusals."""

import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import testing
from qwen35_lib.checkpoint import load_hf_checkpoint, load_mtp
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
from qwen35_lib.engine.batch import SeqWork, pack
from qwen35_lib.engine.speculative import accept, check_request, check_speculative
from qwen35_lib.plan import SINGLE, get_layout, make_mesh

EC = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=64)
TIGHT = dict(EC, num_pages=9)  # 8 pages of 8 for requests of 17 pages in all: preemptions
PARAMS = [SamplingParams(max_new_tokens=n) for n in (14, 9, 20, 12)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A test checkpoint with an MTP head (float32), read back as the engine serves it."""
    pytest.importorskip("transformers")
    path = testing.save_hf_checkpoint(testing.make_hf_model(), tmp_path_factory.mktemp("spec") / "ckpt", "fused",
                                      mtp=True)
    cfg, w = load_hf_checkpoint(path, eos_token_ids=())
    return cfg, w, load_mtp(path, eos_token_ids=())[1]


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(0)
    return [rng.integers(0, model[0].vocab_size, n).tolist() for n in (21, 1, 30, 7)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Greedy outputs without speculation, each request alone."""
    cfg, w, _ = model
    engine = Engine(cfg, w, EngineConfig(**EC))
    return [engine.generate([p], [sp])[0].output_ids for p, sp in zip(prompts, PARAMS)]


def test_accept_keeps_the_longest_matching_prefix_and_the_next_token():
    V = 4
    rows = [SeqWork([5, 1, 2, 3], 10, [1, 2], 1), SeqWork([5, 1, 9, 3], 10, [3, 4], 2),
            SeqWork([5, 7, 2, 3], 10, [5, 6], 3), SeqWork([5, 1], 10, [7, 8], 4)]
    tokens, meta = pack(rows, [SeqWork([1, 2, 3], 0, [9], 5)], 4, 4 * V + 8, 6, 4, 8, width=V)
    targets = np.zeros((1, 6, V), np.int32)
    targets[0, :4] = [1, 2, 3, 4]  # the target's tokens after each of a row's tokens
    got = np.asarray(accept(tokens[None], type(meta)(*(f[None] for f in meta)), targets))
    # all 3 drafts right: 4 kept; the second wrong: 2; the first wrong: 1; one draft (right) of a shorter row: 2
    assert got.tolist() == [[4, 2, 1, 2, 1, 1]]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_is_the_same_with_drafts_verified(model, prompts, reference, k):
    """A random head (drafts almost never right: each step verifies k drafts and rolls back), alone and batched
    with preemption: the outputs are the ones without speculation."""
    cfg, w, head = model
    alone = Engine(cfg, w, EngineConfig(**EC, speculative_tokens=k), mtp_weights=head)
    assert alone.generate([prompts[0]], [PARAMS[0]])[0].output_ids == reference[0]
    assert alone.stats.drafted >= k * (PARAMS[0].max_new_tokens - 1) // 2
    engine = Engine(cfg, w, EngineConfig(**TIGHT, speculative_tokens=k), mtp_weights=head)
    assert [r.output_ids for r in engine.generate(prompts, PARAMS)] == reference
    assert engine.preemptions > 0 and engine.stats.drafted > 0


def oracle(engine, reference, prompts, right):
    """A stand-in drafter whose drafts are the reference's greedy continuation, the first `right(k)` of each right and
    the rest off by one: acceptance of any length, every step."""
    full = {tuple(p): p + out for p, out in zip(prompts, reference)}

    def draft(cfg, plan, k, weights, head, cache, hidden, tokens, meta, targets, accepted, ids, src):
        drafts = np.zeros((*accepted.shape, k), np.int32)
        meta = [np.asarray(f) for f in meta]
        slots, positions, q_start, q_len = meta[6], meta[1], meta[2], meta[3]
        for rank, sched in enumerate(engine.ranks):
            for s in range(accepted.shape[1]):
                r = next((q for q in sched.running if q.slot and q.slot == slots[rank, s] and q_len[rank, s]), None)
                if r is None:
                    continue
                last = q_start[rank, s] + (int(accepted[rank, s]) if s < meta[7].shape[1] and
                                           meta[7][rank, s] >= 0 else q_len[rank, s]) - 1
                after = full[tuple(r.prompt)][positions[rank, last] + 2:]
                want = (after + [0] * k)[:k]
                n = right(k)
                drafts[rank, s] = [t if j < n else (t + 1) % cfg.vocab_size for j, t in enumerate(want)]
        return jnp.asarray(drafts), cache

    engine.draft_fn = draft
    return engine


@pytest.mark.parametrize("k", [2, 3])
def test_accepted_drafts_are_kept_and_the_output_is_the_same(model, prompts, reference, k):
    """Drafts right (an oracle drafter): every one accepted, k + 1 tokens a step; then right for a random number of
    positions: partial acceptance rolls the GDN state back to a position inside the verified row."""
    cfg, w, head = model
    engine = oracle(Engine(cfg, w, EngineConfig(**EC, speculative_tokens=k), mtp_weights=head), reference, prompts,
                    lambda k: k)
    assert engine.generate([prompts[2]], [PARAMS[2]])[0].output_ids == reference[2]
    assert engine.stats.accepted == engine.stats.drafted > 0
    assert engine.stats.steps <= 2 + -(-PARAMS[2].max_new_tokens // (k + 1))  # prefill, then k + 1 a step
    rng = np.random.default_rng(k)
    engine = oracle(Engine(cfg, w, EngineConfig(**TIGHT, speculative_tokens=k), mtp_weights=head), reference,
                    prompts, lambda k: int(rng.integers(0, k + 1)))
    assert [r.output_ids for r in engine.generate(prompts, PARAMS)] == reference
    assert 0 < engine.stats.accepted < engine.stats.drafted and engine.preemptions > 0


def test_dp_ep_verifies_as_one_device(model, prompts, reference):
    cfg, w, head = model
    engine = Engine(cfg, w, EngineConfig(**EC, speculative_tokens=2), mesh=make_mesh(), plan=get_layout("dp_ep"),
                    mtp_weights=head)
    assert [r.output_ids for r in engine.generate(prompts, PARAMS)] == reference
    assert engine.stats.drafted > 0


def test_refusals_are_one_line(model):
    cfg, w, head = model
    with pytest.raises(ValueError, match="drafts with the model's MTP head, and none was given"):
        Engine(cfg, w, EngineConfig(**EC, speculative_tokens=2))
    plan = SINGLE.bound(None, cfg)
    check_speculative(plan, 0, None)  # off: nothing to check
    with pytest.raises(ValueError, match="gdn kernels .* not 'pallas'"):
        check_speculative(SINGLE.replace(gdn_kernel="pallas").bound(None, cfg), 2, head)
    with pytest.raises(ValueError, match="runs under layouts .* not 'tp8_kvrep'"):
        check_speculative(get_layout("tp8_kvrep").bound(make_mesh(), cfg), 2, head)
    with pytest.raises(ValueError, match="greedy only"):
        check_request(2, SamplingParams(temperature=0.7))
    check_request(0, SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="speculative_tokens must be >= 0"):
        EngineConfig(speculative_tokens=-1)
