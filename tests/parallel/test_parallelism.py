"""Every layout, routing and collective flag against the single-device model, on 8 simulated CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import forward, get_config, init_weights
from qwen35_lib.engine.engine import Engine
from qwen35_lib.engine.engine_config import EngineConfig
from qwen35_lib.engine.sampling import SamplingParams
from qwen35_lib.model.moe import local_moe, route
from qwen35_lib.parallel import shard_weights
from qwen35_lib.parallel.routing import moe_ep, predicted_drops
from qwen35_lib.plan import ROUTINGS, ServingPlan, get_stage

# Every valid (routing, fuse_allgather, hierarchical_rs) under dp8_ep8 (the flags apply to EP + replicate only); under
# dp4_tp2_ep8, whose MoE runs the same EP code, each routing with the flags off and on; tp8_ep8 (every token on every
# device: nothing to fuse) with each routing.
EP_SETTINGS = [("replicate", f, h) for f in (False, True) for h in (False, True)] + [("all_to_all", False, False)]
SETTINGS = [("tp8_kvrep", "replicate", False, False)] + [("dp8_ep8", *s) for s in EP_SETTINGS] + [
    ("dp4_tp2_ep8", *s) for s in EP_SETTINGS if s[1] == s[2]] + [("tp8_ep8", r, False, False) for r in ROUTINGS]
# 2 layer groups, so the layer scan stays a loop in the compiled HLO
BASE = get_config("qwen3.5-tiny", dtype="float32", num_layers=8)


@pytest.fixture(scope="module")
def weights():
    return init_weights(BASE, 0)


def _plan(layout, routing="replicate", fuse=False, hier=False, **kw):
    return ServingPlan(layout, layout, routing, fuse, hier, kernels=None, **kw)


def test_layouts_that_cannot_work_are_refused_with_the_fix(mesh, weights):
    with pytest.raises(ValueError, match=r"2 KV heads cannot be split over 8 devices.*'dp8_ep8'.*'tp8_kvrep'"):
        _plan("tp8").bind(mesh, BASE)
    with pytest.raises(ValueError, match="12 experts cannot be split evenly over 8 devices"):
        _plan("dp8_ep8").bind(mesh, BASE.replace(num_experts=12))
    with pytest.raises(ValueError, match="routing='replicate' only"):
        _plan("dp8_ep8", "all_to_all", fuse=True).bind(mesh, BASE)
    with pytest.raises(ValueError, match="'tp8_ep8' has every token on every device: no all-gather"):
        _plan("tp8_ep8", fuse=True).bind(mesh, BASE)
    with pytest.raises(ValueError, match="needs a mesh"):
        _plan("dp8_ep8").bind(None, BASE)
    with pytest.raises(ValueError, match="set_mesh"):  # a layout used without a mesh says how to give one
        forward(BASE, weights, np.ones((1, 4), np.int32), plan=_plan("dp8_ep8"))


@pytest.fixture(scope="module")
def tokens_and_reference(weights):
    tokens = np.random.RandomState(0).randint(0, BASE.vocab_size, (3, 21)).astype(np.int32)
    return tokens, np.asarray(forward(BASE, weights, tokens, lengths=[21, 9, 1]))


@pytest.mark.parametrize("layout,routing,fuse,hier", SETTINGS, ids=lambda v: str(v))
def test_logits_equal_single_device(layout, routing, fuse, hier, mesh, weights, tokens_and_reference):
    tokens, ref = tokens_and_reference
    plan = _plan(layout, routing, fuse, hier).bind(mesh, BASE)
    with jax.set_mesh(mesh):
        out = np.asarray(forward(BASE, shard_weights(BASE, plan, weights, mesh), tokens, lengths=[21, 9, 1],
                                 plan=plan))
    # float32: a layout only reorders sums (per-expert partial outputs reduced across devices, TP partial
    # matmuls all-reduced), a few ulps of the hidden state per layer; logits are O(1).
    valid = np.arange(21)[None, :] < np.array([21, 9, 1])[:, None]
    np.testing.assert_allclose(out[valid], ref[valid], atol=2e-5, rtol=1e-5)


def test_all_to_all_is_dropless_by_default_and_counts_drops(mesh, weights):
    w = jax.tree.map(lambda a: a[0, 0], weights["layers"]["moe"])  # layer 0
    x = jax.random.normal(jax.random.key(3), (64, BASE.hidden_size))
    ref = local_moe(BASE, w, x)

    def run(plan):
        plan = plan.bind(mesh, BASE)
        f = jax.jit(lambda w, x: moe_ep(BASE, w, x, route, plan))
        with jax.set_mesh(mesh):
            out, dropped = f(w, x)
        return np.asarray(out), int(dropped)

    out, dropped = run(_plan("dp8_ep8", "all_to_all"))
    assert dropped == 0
    shared = local_moe(BASE, dict(w, w_down=jnp.zeros_like(w["w_down"])), x)  # the shared expert alone
    np.testing.assert_allclose(out, np.asarray(ref - shared), atol=1e-5)
    capped = _plan("dp8_ep8", "all_to_all", capacity_factor=0.25)  # 1/4 of the mean slots per device
    out, dropped = run(capped)
    assert dropped > 0
    assert dropped == predicted_drops(BASE, capped, route(BASE, w["router"], x)[1])  # the arithmetic count
    assert not np.allclose(out, np.asarray(ref - shared), atol=1e-5)


# --- the engine, end to end: greedy tokens equal the single-device engine's -----------------------------------
EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=48, page_size=8)
GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True)
PROMPTS = [list(np.random.RandomState(i).randint(2, BASE.vocab_size, n)) for i, n in
           enumerate((5, 17, 1, 9, 30, 3, 12, 7, 2))]


@pytest.fixture(scope="module")
def reference_tokens(weights):
    return [r.output_ids for r in Engine(BASE, weights, EC).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("layout,routing,fuse,hier", [("tp8_kvrep", "replicate", False, False),
                                                      ("tp8_ep8", "replicate", False, False),
                                                      ("dp8_ep8", "all_to_all", False, False),
                                                      ("dp8_ep8", "replicate", True, True)], ids=str)
def test_engine_greedy_tokens_equal_single_device(layout, routing, fuse, hier, mesh, weights, reference_tokens):
    engine = Engine(BASE, weights, EC, mesh=mesh, plan=_plan(layout, routing, fuse, hier))
    assert engine.ec.ranks == (8 if layout == "dp8_ep8" else 1)  # tp8_ep8: one rank, as tp8_kvrep
    # the first 5 prompts (5-30 tokens: chunked prefills beside decodes, two sequences at most): fewer step shapes to
    # compile than all 9 (a third of CI's 47 s), the same kinds of step
    assert [r.output_ids for r in engine.generate(PROMPTS[:5], GREEDY)] == reference_tokens[:5]
    if layout == "dp8_ep8" and routing == "replicate":  # 1, 3 and 9 requests: fewer requests than ranks too
        for n in (1, 3):
            assert [r.output_ids for r in engine.generate(PROMPTS[:n], GREEDY)] == reference_tokens[:n]


def test_every_stage_is_a_complete_valid_plan(mesh):
    from qwen35_lib.plan import LADDER

    layouts = [get_stage(s).bind(mesh, get_config("qwen3.5-mini")).layout for s in LADDER]
    assert layouts == ["tp8_kvrep"] + ["dp8_ep8"] * 5
    top = get_stage("kernels").bind(mesh, get_config("qwen3.5-mini"))
    assert top.fuse_allgather and top.hierarchical_rs and top.kernel("moe_matmul") == "pallas"


def test_kernels_stage_every_pallas_kernel_under_dp8_ep8(mesh, weights, reference_tokens):
    """The top of the ladder: dp8_ep8 + replicate + both flags + all four Pallas kernels (interpret mode here),
    per rank inside shard_maps, gives the single-device XLA engine's tokens."""
    engine = Engine(BASE, weights, EC, mesh=mesh, plan=get_stage("kernels"))
    assert [r.output_ids for r in engine.generate(PROMPTS[:3], GREEDY)] == reference_tokens[:3]


def test_google_baseline_every_pallas_kernel_under_tp8_kvrep(mesh, weights, reference_tokens):
    """The 2 x 2's TP + Pallas corner in this engine: tp8_kvrep with the Pallas attention and GDN on each device's
    own heads (`parallel.ranks._ranks_and_heads`), the Pallas grouped matmul and permute in the TP MoE, XLA's dense
    projections on the head-split weights (the `dense` slot resolves to 'xla' there), gives the single-device XLA
    engine's tokens."""
    from qwen35_lib.plan import any_stage

    plan = any_stage("google_baseline")
    engine = Engine(BASE, weights, EC, mesh=mesh, plan=plan)
    assert engine.plan.kernel("attention") == engine.plan.kernel("gdn") == "pallas"
    assert engine.plan.kernel("dense") == "xla"
    assert [r.output_ids for r in engine.generate(PROMPTS[:3], GREEDY)] == reference_tokens[:3]


def test_fused_ep_stage_gives_the_kernels_stage_tokens(mesh, weights, reference_tokens):
    """Beyond the ladder (issue 50, item 4): the kernels stage with the MoE's dispatch and combine fused into the
    grouped matmul (`kernels.moe.fused_ep` on a TPU; here its XLA twin `routing.fused_twin`, the kernel's TPU
    interpreter blocking inside the engine's step: tests/kernels/moe/test_fused_ep.py checks the kernel against the
    twin) gives the single-device XLA engine's tokens, as the kernels stage does."""
    from qwen35_lib.plan import any_stage

    engine = Engine(BASE, weights, EC, mesh=mesh, plan=any_stage("fused_ep"))
    assert engine.plan.fused_combine and not engine.plan.hierarchical_rs
    assert [r.output_ids for r in engine.generate(PROMPTS[:3], GREEDY)] == reference_tokens[:3]
