"""The whole model with every Pallas kernel swapped in at once (attention, gdn, moe_matmul, permute = "pallas",
interpret mode on CPU) against the reference path (the XLA kernels), on `qwen3.5-tiny` in float32.

1. The engine end to end: greedy tokens equal, over a schedule that mixes prefill chunks with decodes and a prompt
   that spans several pages (and is chunked: its second chunk starts mid-sequence from its slot state).
2. The ragged step's logits (`ragged_forward`, the function the engine jits) against `forward` with the XLA
   kernels, at every sampled position of a mixed step.

Tolerance of 2: each Pallas kernel does its twin's float32 math in another summation order (attention: pages
grouped per softmax update; GDN: the chunk's WY/UT inverse by block doubling on the chip; MoE: row and FFN tiles;
permute: the combine's float32 sum). Alone each agrees with its twin to ~1e-6 relative (tests/kernels/*/test_pallas.py).
Through 4 layers the rounding differences add, not multiply (no layer amplifies a 1e-6 perturbation by more
than its O(1) gain). Seen: at most 2.6e-7 on logits of magnitude ~0.45, so atol = rtol = 1e-5 leaves a 40x margin
for other CPUs and XLA versions, while a wrong page, slot, group or tile (an O(1) error) fails it by 4 orders.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import forward, get_config, init_weights
from qwen35_lib.engine.batch import SeqWork, pack, stack_ranks
from qwen35_lib.engine.cache import CacheShape, init_cache
from qwen35_lib.engine.engine import Engine
from qwen35_lib.engine.engine_config import EngineConfig
from qwen35_lib.engine.sampling import SamplingParams
from qwen35_lib.model.ragged import ragged_forward
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.plan import SINGLE

XLA = SINGLE.replace(attention_kernel="xla", gdn_kernel="xla", moe_kernel="ragged_dot", permute_kernel="xla")
PALLAS = SINGLE.replace(kernels="pallas")
TOL = 1e-5


@pytest.fixture(scope="module")
def run():
    """The Pallas engine's greedy outputs, and the XLA-kernel `forward`'s logits over prompt + outputs."""
    ref = pallas = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(ref, 0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, ref.vocab_size, n).tolist() for n in (5, 45)]
    engine = Engine(pallas, w, EngineConfig(max_num_seqs=2, max_num_batched_tokens=40, page_size=8,
                                            max_model_len=64), plan=PALLAS)
    outs = [r.output_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))]
    seqs = [p + o for p, o in zip(prompts, outs)]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    logits = np.asarray(forward(ref, w, ids, np.array([len(s) for s in seqs]), plan=XLA))  # [2, 48, V]
    return pallas, w, prompts, outs, engine.stats, seqs, logits


def test_engine_with_every_pallas_kernel_matches_xla(run):
    """Budget 40 tokens a step, pages of 8: B's 5-token prompt goes first; A's 45-token prompt (6 pages) is
    prefilled in two chunks, the second next to B's decode (a mixed step), then both decode. The reference
    greedy tokens by teacher forcing: token i of a request is the argmax of the XLA-kernel logits after its
    prompt and its first i tokens, so by induction the outputs equal the XLA path's greedy generation."""
    _, _, prompts, outs, stats, _, logits = run
    for b, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o) == 3
        ref_tokens = logits[b, len(p) - 1:len(p) + 2].argmax(-1).tolist()
        assert o == ref_tokens, (b, o, ref_tokens)
    assert stats.mixed_steps >= 1, "no step mixed prefill chunks with decodes"
    assert max(stats.tokens) > 8, "no prefill chunk spanning several pages"


def test_ragged_step_logits_with_every_pallas_kernel_match_forward(run):
    """`ragged_forward` (the function the engine's step jits) with all four Pallas kernels, on the same
    sequences: step 1 prefills A's first 20 tokens and B's 5; step 2 decodes B next to A's chunk 20..47, which
    starts mid-page and mid-sequence (from A's slot state and 3 cached pages; 6 pages, shuffled). Every sampled
    row's logits against the XLA-kernel `forward` over the whole sequences."""
    pallas, w, _, _, _, (B, A), logits = run
    seqs, full = {"A": A, "B": B}, {"A": logits[1], "B": logits[0]}
    pages, slots = {"A": [3, 7, 1, 9, 5, 11], "B": [2]}, {"A": 1, "B": 2}
    work = lambda n, a, b: SeqWork(seqs[n][a:b], a, pages[n], slots[n])  # noqa: E731
    step = jax.jit(lambda cfg, *args: ragged_forward(cfg, *args, parallelism(PALLAS)), static_argnums=0)
    cache = init_cache(pallas, CacheShape(ranks=1, num_pages=12, page_size=8, num_slots=3))
    schedule = [([], [("A", 0, 20), ("B", 0, 5)]), ([("B", 5, 6)], [("A", 20, 47)])]
    for decodes, prefills in schedule:
        tokens, meta = stack_ranks([pack([work(*d) for d in decodes], [work(*p) for p in prefills], D=1, T=129,
                                         S=2, max_pages=6, chunk=64)])
        out, cache = step(pallas, w, cache, jnp.asarray(tokens), jax.tree.map(jnp.asarray, meta))
        for s, (n, _, b) in enumerate(decodes + prefills):
            np.testing.assert_allclose(np.asarray(out[0, s]), full[n][b - 1], atol=TOL, rtol=TOL)
