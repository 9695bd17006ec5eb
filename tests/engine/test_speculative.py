"""engine.speculative: greedy output with drafts verified is the output without them (random heads: acceptance ~0,
so every step verifies and rolls back; an oracle drafter: multi-token acceptance), alone, batched with preemption
and under dp_ep and the tensor-parallel layouts; the acceptance rule by hand; the refusals."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from scipy import stats

from qwen35_lib import testing
from qwen35_lib.checkpoint import load_hf_checkpoint, load_mtp
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
from qwen35_lib.engine.batch import SeqWork, pack
from qwen35_lib.engine.cache import CacheShape, declare_cache
from qwen35_lib.engine.sampling import token_keys
from qwen35_lib.engine.speculative import accept, check_request, check_speculative, rejection_sample
from qwen35_lib.kernels.gdn import xla as gdn_xla
from qwen35_lib.model.ragged import keep_accepted
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.parallel.shardings import spec as layout_spec
from qwen35_lib.plan import SINGLE, get_layout, make_mesh

EC = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=64)
TIGHT = dict(EC, num_pages=9)  # 8 pages of 8 for requests of 17 pages in all: preemptions
PARAMS = [SamplingParams(max_new_tokens=n) for n in (14, 9, 20, 12)]
SAMPLED = [SamplingParams(max_new_tokens=n, temperature=1.0, top_k=4, top_p=0.95, seed=s)
           for n, s in ((14, 1), (9, 2), (20, 3), (12, 4))]


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
def plain(model):
    """A one-device engine without speculation."""
    cfg, w, _ = model
    return Engine(cfg, w, EngineConfig(**EC))


@pytest.fixture(scope="module")
def reference(plain, prompts):
    """Greedy outputs without speculation, each request alone."""
    return [plain.generate([p], [sp])[0].output_ids for p, sp in zip(prompts, PARAMS)]


@pytest.fixture(scope="module")
def sampled_alone(model, prompts):
    """A one-device engine with k = 2 and its seeded outputs of SAMPLED, each request alone."""
    cfg, w, head = model
    engine = Engine(cfg, w, EngineConfig(**EC, speculative_tokens=2), mtp_weights=head)
    return engine, [engine.generate([p], [sp])[0].output_ids for p, sp in zip(prompts, SAMPLED)]


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
    with preemption: the outputs are the ones without speculation. One engine for both (the request alone fits its
    8 pages), so the batched run reuses the steps the lone one compiled."""
    cfg, w, head = model
    engine = Engine(cfg, w, EngineConfig(**TIGHT, speculative_tokens=k), mtp_weights=head)
    assert engine.generate([prompts[0]], [PARAMS[0]])[0].output_ids == reference[0]
    assert engine.preemptions == 0 and engine.stats.drafted >= k * (PARAMS[0].max_new_tokens - 1) // 2
    drafted = engine.stats.drafted
    assert [r.output_ids for r in engine.generate(prompts, PARAMS)] == reference
    assert engine.preemptions > 0 and engine.stats.drafted > drafted


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


# penalties, a bias that a frequency penalty wears down (its count decides each position), bad words, min_tokens
PROCESSED = [SamplingParams(max_new_tokens=n, presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3,
                            logit_bias=((7, 4.0), (11, 3.0)), bad_words_ids=((5, 9), (13,)), min_tokens=2)
             for n in (20, 12)]


def test_logits_processing_applies_to_each_verified_position(model, prompts, reference, plain):
    """k = 3 with an oracle drafter (the processed greedy continuation, right for a random number of positions),
    two requests batched with preemption (10 pages of 8): the outputs are the processed ones without drafts (which
    differ from the unprocessed ones). Each position is processed after the drafts before it: with the request's
    outputs alone there, a position after an accepted draft counts the penalties and bias wrong and takes other
    tokens."""
    cfg, w, head = model
    two = prompts[2:]
    want = [r.output_ids for r in plain.generate(two, PROCESSED)]
    assert want != reference[2:]
    rng = np.random.default_rng(1)
    engine = oracle(Engine(cfg, w, EngineConfig(**TIGHT, speculative_tokens=3), mtp_weights=head), want, two,
                    lambda k: int(rng.integers(0, k + 1)))
    assert [r.output_ids for r in engine.generate(two, PROCESSED)] == want
    assert 0 < engine.stats.accepted < engine.stats.drafted and engine.preemptions > 0


def test_dp_ep_verifies_as_one_device(model, prompts, reference, sampled_alone):
    """k = 2 under dp_ep, one engine: greedy outputs are one device's without drafts, and seeded sampling's are one
    device's with drafts (the keys are the requests' own)."""
    cfg, w, head = model
    engine = Engine(cfg, w, EngineConfig(**EC, speculative_tokens=2), mesh=make_mesh(), plan=get_layout("dp_ep"),
                    mtp_weights=head)
    assert [r.output_ids for r in engine.generate(prompts, PARAMS)] == reference
    assert engine.stats.drafted > 0
    assert [r.output_ids for r in engine.generate(prompts, SAMPLED)] == sampled_alone[1]


def _spec(engine, name: str) -> tuple:
    """The PartitionSpec of `engine`'s cache pool `name`, one entry a dim."""
    a = engine.cache[name]
    return tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))


# (layout, devices, k), on meshes whose size splits the test checkpoint's 4 GDN value heads (over 8 devices they stay
# whole): every head axis over 2 devices (`tp`), over 4 with the experts split too (`tp_ep`, tpu-inference's TP_EP:
# the 2 KV heads duplicated to 1 a device, the 2 GDN key heads whole); k = 2 verifies under dp_ep and one device
# (dp4_tp2_ep8 at k = 2, heads over a chip's 2 cores with 4 ranks, passed too: 12 s of CI, dropped for the budget)
TP_CASES = [("tp", 2, 3, True), ("tp_ep", 4, 1, False)]  # tp_ep: the lone request only (the batch's preemptions
# and buckets are tp's and the single device's; about 10 s of CI)


@pytest.mark.parametrize("layout,devices,k,batched", TP_CASES)
def test_tensor_parallel_layouts_verify_as_one_device(model, prompts, reference, layout, devices, k, batched):
    """Heads split over devices: the checkpoint pools are placed as the GDN state (each device its heads' states
    and conv windows), and the greedy outputs are one device's without drafts, alone and batched (with preemption
    where one rank serves the batch). One engine for both, as the single-device test."""
    cfg, w, head = model
    engine = Engine(cfg, w, EngineConfig(**TIGHT, speculative_tokens=k), mesh=make_mesh(jax.devices()[:devices]),
                    plan=get_layout(layout), mtp_weights=head)
    assert _spec(engine, "state")[3] == engine.plan.axes("gdn_v_heads") is not None  # the state split by heads
    for name in ("conv_q", "conv_k", "conv_v", "state"):  # the slot's checkpoint axis unsplit, the rest as the pool
        want = _spec(engine, name)
        assert _spec(engine, f"{name}_ckpt") == (*want[:3], None, *want[3 + (name != "state"):])
    assert engine.generate([prompts[0]], [PARAMS[0]])[0].output_ids == reference[0]
    assert engine.preemptions == 0 and engine.stats.drafted >= k * (PARAMS[0].max_new_tokens - 1) // 2
    drafted = engine.stats.drafted
    if batched:
        assert [r.output_ids for r in engine.generate(prompts, PARAMS)] == reference
        assert engine.stats.drafted > drafted and (engine.preemptions > 0) == (engine.ec.ranks == 1)


def test_rollback_is_exact_with_gdn_heads_split(model):
    """The GDN's verification and rollback as the engine runs them under `tp` on 2 devices (the value heads split,
    the pools placed by the plan, the kernel partitioned by XLA): 3 decode rows of V = 3 tokens, then
    `keep_accepted` with 1, 2 and 3 tokens kept: each slot's state is, bitwise in float32, the state of decoding its
    kept tokens one at a time on one device (`gdn_decode_xla`, the k = 0 path)."""
    cfg = model[0]
    D, V, Hk, Hv, dk, dv = 3, 3, cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    mesh = make_mesh(jax.devices()[:2])
    plan = get_layout("tp").bound(mesh, cfg)
    _, meta = pack([SeqWork([1] * V, 5, [1], i + 1) for i in range(D)], [], D, D * V, D, 4, 8, width=V)
    meta = type(meta)(*(jnp.asarray(f)[None] for f in meta))
    ks = jax.random.split(jax.random.key(3), 6)
    q, k = (jax.random.normal(key, (1, D * V, Hk, dk)) for key in ks[:2])
    v = jax.random.normal(ks[2], (1, D * V, Hv, dv))
    g, beta = -jax.nn.softplus(jax.random.normal(ks[3], (1, D * V, Hv))), jax.nn.sigmoid(jax.random.normal(ks[4], (
        1, D * V, Hv)))
    states = 0.1 * jax.random.normal(ks[5], (1, 1, D + 1, Hv, dk, dv))  # [R, L, NS, ...]: one rank and layer
    decl = declare_cache(cfg, CacheShape(num_slots=D + 1, verify=V))
    place = lambda x, name: jax.device_put(x, NamedSharding(mesh, layout_spec(plan, mesh, decl[name].logical_axes,
                                                                                x.shape)))
    pools = {"state": place(states, "state"), "state_ckpt": place(jnp.zeros((1, 1, D + 1, V, Hv, dk, dv)),
                                                                   "state_ckpt")}
    assert pools["state_ckpt"].sharding.spec[4] == pools["state"].sharding.spec[3] == plan.axes("gdn_v_heads")
    accepted = jnp.array([[1, 2, 3]], jnp.int32)

    @jax.jit
    def verify_and_keep(pools, q, k, v, g, beta):
        run = lambda *a: gdn_xla.gdn_ragged_xla(*a[:-1], chunk_size=8, checkpoints=a[-1])
        _, state, ckpt = parallelism(plan).per_rank(cfg, "gdn", run, q, k, v, g, beta, pools["state"][:, 0], meta,
                                                    pools["state_ckpt"][:, 0])
        return keep_accepted({"state": state[:, None], "state_ckpt": ckpt[:, None]}, meta, accepted)["state"]

    with jax.set_mesh(mesh):
        kept = np.asarray(verify_and_keep(pools, q, k, v, g, beta))[0, 0]
    decode = jax.jit(gdn_xla.gdn_decode_xla)
    for i, n in enumerate(accepted[0].tolist()):
        s = states[0, 0]
        for t in range(i * V, i * V + n):
            _, s = decode(*(x[0, t:t + 1] for x in (q, k, v, g, beta)), jnp.array([i + 1]), jnp.array([True]), s)
        np.testing.assert_array_equal(kept[i + 1], s[i + 1])


def test_a_workload_with_drafts_precompiles_every_decode_bucket_below_its_largest(model):
    """Sequences with drafts finish at steps the acceptance decides, so a run may step with any smaller decode bucket
    (the dry run keeps one token a step: bench mtp's workload, 16 prompts of 16 + 64, missed D = 1, and the run
    compiled while timed)."""
    cfg, w, head = model
    ec = EngineConfig(max_num_seqs=16, max_num_batched_tokens=80, max_model_len=84, speculative_tokens=3)
    engine = Engine(cfg, w, ec, mtp_weights=head)
    assert isinstance(engine.mtp_weights["layers"], tuple)  # the head's layer per-layer, as the model's (XLA:CPU)
    got = engine.workload_buckets([16] * 16, 64)
    assert {(d, 4 * d) for d in (1, 2, 4, 8, 16)} <= set(got)  # pure decode steps: D rows of 4 tokens


def test_refusals_are_one_line(model):
    cfg, w, head = model
    with pytest.raises(ValueError, match="drafts with the model's MTP head, and none was given"):
        Engine(cfg, w, EngineConfig(**EC, speculative_tokens=2))
    plan = SINGLE.bound(None, cfg)
    check_speculative(plan, 0, None)  # off: nothing to check
    with pytest.raises(ValueError, match="attention kernels .* not 'pallas'"):
        check_speculative(SINGLE.replace(attention_kernel="pallas").bound(None, cfg), 2, head)
    check_speculative(SINGLE.replace(gdn_kernel="pallas").bound(None, cfg), 2, head)  # its verify kernel
    check_speculative(get_layout("tp8_kvrep").bound(make_mesh(), cfg), 2, head)  # every layout: served
    check_request(2, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1))  # sampling: served
    check_request(2, SamplingParams(temperature=0.7, presence_penalty=0.5))  # logits processing: served
    grammar = SamplingParams(structured=types.SimpleNamespace(matcher=lambda: None))
    with pytest.raises(ValueError, match="cannot apply structured output"):
        check_request(2, grammar)
    check_request(0, grammar)
    with pytest.raises(ValueError, match="speculative_tokens must be >= 0"):
        EngineConfig(speculative_tokens=-1)


def fits(tokens: np.ndarray, p: np.ndarray) -> bool:
    """Whether tokens drawn from a vocabulary of len(p) fit the distribution p: a chi-square test at 0.1%."""
    seen = np.bincount(tokens, minlength=len(p))
    if seen[p == 0].any():
        return False
    return stats.chisquare(seen[p > 0], len(tokens) * p[p > 0]).pvalue > 1e-3


@pytest.mark.parametrize("drafter", ["sampled", "point"])
def test_rejection_sampling_keeps_the_target_distribution(drafter):
    """Speculative sampling, k = 2 drafts over a vocabulary of 6: drafts from q (or point masses, the engine's greedy
    head), the first token out is distributed as p_0 and the second, when the first was an accepted draft, as p_1
    (the target after it); the bonus token (both accepted) as p_2. Accepting every draft (the drafts as outputs) fails
    the same test."""
    N, V = 40000, 6
    p = np.array([[0.05, 0.4, 0.25, 0.0, 0.2, 0.1], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])
    q = np.array([[0.3, 0.1, 0.1, 0.3, 0.1, 0.1], [0.05, 0.05, 0.6, 0.1, 0.1, 0.1]])
    rng = np.random.default_rng(0)
    if drafter == "sampled":
        drafts = np.stack([rng.choice(V, N, p=q[j]) for j in range(2)], axis=1).astype(np.int32)
        qs = jnp.broadcast_to(q, (N, 2, V)).astype(jnp.float32)
    else:
        drafts, qs = np.tile(np.array([[1, 2]], np.int32), (N, 1)), None
    keys = token_keys(jnp.broadcast_to(jnp.arange(N, dtype=jnp.uint32)[:, None], (N, 3)),
                      jnp.broadcast_to(jnp.arange(10, 13, dtype=jnp.int32), (N, 3)))
    tokens, kept = jax.jit(rejection_sample)(jnp.broadcast_to(p, (N, 3, V)).astype(jnp.float32), drafts,
                                             jnp.full(N, 2, jnp.int32), keys, qs)
    tokens, kept = np.asarray(tokens), np.asarray(kept)
    assert fits(tokens[:, 0], p[0]) and fits(tokens[kept >= 2, 1], p[1]) and fits(tokens[kept == 3, 2], p[2])
    assert set(np.unique(kept)) == {1, 2, 3}  # every path taken: a rejection at 1, at 2, both accepted
    np.testing.assert_array_equal(tokens[kept >= 2, 0], drafts[kept >= 2, 0])  # kept drafts are the drafts
    assert (tokens[kept == 1, 0] != drafts[kept == 1, 0]).all()  # a rejected draft is never resampled
    assert not fits(drafts[:, 0], p[0])  # the wrong rule: every draft accepted
    again, _ = jax.jit(rejection_sample)(jnp.broadcast_to(p, (N, 3, V)).astype(jnp.float32), drafts,
                                         jnp.full(N, 2, jnp.int32), keys, qs)
    np.testing.assert_array_equal(np.asarray(again), tokens)  # the same keys, the same tokens


def test_seeded_sampling_with_drafts_is_reproducible(model, prompts, sampled_alone):
    """Temperature > 0 with k = 2: the same seeds give the same outputs, run again or batched with preemption; other
    seeds give other outputs."""
    cfg, w, head = model
    engine, alone = sampled_alone
    assert [engine.generate([p], [sp])[0].output_ids for p, sp in zip(prompts, SAMPLED)] == alone
    tight = Engine(cfg, w, EngineConfig(**TIGHT, speculative_tokens=2), mtp_weights=head)
    assert [r.output_ids for r in tight.generate(prompts, SAMPLED)] == alone
    assert tight.preemptions > 0 and tight.stats.drafted > 0
    other = [dataclasses.replace(sp, seed=sp.seed + 10) for sp in SAMPLED]
    assert [r.output_ids for r in tight.generate(prompts, other)] != alone


def test_sampling_with_drafts_keeps_the_engine_distribution(model, prompts, reference):
    """The engine with k = 2 and an oracle drafter (drafts the greedy continuation: often accepted) against k = 0,
    many seeds of one prompt at temperature 1 / top_k 3: the second and third output tokens (drawn through
    verification) have the same distribution (a two-sample chi-square test at 0.1%), and the drafts were both
    accepted and rejected."""
    cfg, w, head = model
    n = 240
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, seed=s) for s in range(n)]
    # the module's engine config and its 7-token prompt: the steps `plain` and `sampled_alone` compiled, mostly
    # (compiling was 19 s of the 24 this test took with 16 sequences of its 30-token prompt)
    base = Engine(cfg, w, EngineConfig(**EC))
    spec = oracle(Engine(cfg, w, EngineConfig(**EC, speculative_tokens=2), mtp_weights=head), reference, prompts,
                  lambda k: k)
    want = np.array([r.output_ids for r in base.generate([prompts[3]] * n, params)])
    got = np.array([r.output_ids for r in spec.generate([prompts[3]] * n, params)])
    for j in (1, 2):
        ids = np.union1d(want[:, j], got[:, j])
        table = np.array([[np.sum(x[:, j] == t) for t in ids] for x in (want, got)])
        assert stats.chi2_contingency(table).pvalue > 1e-3, (j, table)
    assert 0 < spec.stats.accepted < spec.stats.drafted
