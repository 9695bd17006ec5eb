"""The hierarchical reduce-scatter's phases overlap on the TPU7x schedule (issue 12, item 5): the `hier_rs` stage's
decode step compiled for TPU7x-8 with the public Ironwood Qwen3.5 recipe's flags (`aot.RECIPE_OPTIONS`), read
from the scheduled HLO (`compiled.as_text()`: each computation's instructions in the order they run).

In the layer loop each MoE layer's reduce-scatter is `micro_batches` chains of a phase 1 over `core` (groups of
2 devices) and a phase 2 over `chip` (groups of 4), each phase an async SparseCore collective (call-start /
call-done on TPU7x). The claim: micro-batch i+1's phase 1 starts before micro-batch i's phase 2 is done. The
negative control serialises the chains with `jax.lax.optimization_barrier` (each phase's input tied to the
previous phase's output) and must fail the same check.

Small width: qwen3.5-mini (hidden 512) at 256 requests, so the step's 256 gathered tokens give the 2 micro-batches
the code uses (`plan.micro_batches`: 2 from 256 tokens). At qwen3.5-tiny's hidden 64 XLA turns each phase
2 into one synchronous all-reduce of both micro-batches (too small to be worth a reduce-scatter): no evidence.
The reduce-scatters move [tokens, hidden] partial sums, so the expert count and the vocabulary do not enter them:
8 experts (1 per device) and a 256-token vocabulary compile in ~27 s instead of ~49 s each, to the same schedule
(the hier_rs job checked against 64 experts and a 4096 vocabulary: the same chains, overlap and placement).
Nor do the layers between them: each layer group is one GDN and one attention layer instead of qwen3.5-mini's
3 + 1, so the loop body holds 2 MoE layers (one after a GDN mixer, one after attention, as in the 3 + 1 group)
and 2 groups keep the scan a loop (`hlo.layer_body`). The same chains per MoE layer, overlap (control: none),
placement and all-gather counts as at 3 + 1, in ~12-13 s per compile instead of ~22-27 s (the fixture ~50 s
instead of ~86 s); a context of 256 instead of 512 saved nothing measurable.

The same compiles show the fused all-gather (`fuse_allgather`) on the TPU7x schedule: 2 all-gathers per MoE layer in
the hier_rs step, 3 in the replicate stage's (XLA's combiner does not merge the three); the CPU twin of this check
is in `test_collective_hlo.py`.

`xla_tpu_enable_sparse_core_collective_offload_reduce_scatter`: TPU7x (libtpu 0.0.42.1) offloads the reduce-
scatters to the SparseCore without it; set to false they become synchronous TensorCore ops in program order. That is
checked by notebook 04 on one compiled MoE layer (its schedules with and without the offload), not compiled again here
(the whole step with the flag off cost about 12 s of CI).
"""

import pytest

from qwen35_lib.config import FULL, LINEAR
from tests import aot_subprocess

pytestmark = [pytest.mark.tpu_compile, pytest.mark.timeout(600)]  # the fixture: 3 compiles, one child process
MODEL, REQUESTS, CONTEXT, PAGE = "qwen3.5-mini", 256, 512, 256
# what the reduce-scatters do not depend on (module doc): one GDN and one attention layer per group, not 3 + 1
NARROW = dict(num_experts=8, vocab_size=256, layer_pattern=(LINEAR, FULL))


def _serialised_reduce_scatter(fn):
    """`fn` (routing's reduce_scatter) with every psum_scatter it issues chained to the one before through an
    optimization barrier: micro-batch i+1's phase 1 cannot start before micro-batch i's phase 2 is done."""
    import jax

    def rs(*args, **kwargs):
        real, prev = jax.lax.psum_scatter, []

        def chained(v, axis, **kw):
            if prev:
                v, _ = jax.lax.optimization_barrier((v, prev[-1]))
            prev.append(real(v, axis, **kw))
            return prev[-1]

        jax.lax.psum_scatter = chained
        try:
            return fn(*args, **kwargs)
        finally:
            jax.lax.psum_scatter = real

    return rs


def _schedule(serialised: bool, options: dict | None = None) -> dict:
    """The hier_rs decode step's reduce-scatter chains per MoE layer of the loop, and their overlap."""
    import jax

    from qwen35_lib import aot
    from qwen35_lib.aot import hlo_checks, sweep
    from qwen35_lib.parallel import collectives, hlo, routing
    from qwen35_lib.plan import get_stage, micro_batches

    routing.reduce_scatter = _serialised_reduce_scatter(collectives.reduce_scatter) if serialised else \
        collectives.reduce_scatter
    jax.clear_caches()
    cfg = sweep.serving_config(MODEL, 2, **NARROW)
    opts = aot.RECIPE_OPTIONS if options is None else options
    c = aot.compile_step(cfg, get_stage("hier_rs"), aot.chip_core_mesh(), requests=REQUESTS, context_len=CONTEXT,
                         decode=REQUESTS // 8, page_size=PAGE, kv_dtype="float8_e4m3fn", compiler_options=opts)
    text = c.as_text()
    body = hlo.layer_body(text)
    chains = hlo_checks.rs_chains(text, body)
    m = len(chains) // len(cfg.layer_pattern)  # micro-batches per MoE layer, as compiled
    ops = hlo_checks.collective_schedule(text, body, ("reduce-scatter", "all-reduce"))
    return dict(micro_batches=m, code_micro_batches=micro_batches(REQUESTS), moe_layers=len(cfg.layer_pattern),
                allgathers=_allgathers_per_moe_layer(text, cfg),
                overlapped=hlo_checks.overlapped(chains, m),
                chains=[[(a.start, a.done), (b.start, b.done)] for a, b in chains],
                how=sorted({(o.kind, o.how, o.group_size) for o in ops}))


def _allgathers_per_moe_layer(text: str, cfg) -> float:
    from qwen35_lib.parallel import hlo

    return hlo.count(text, hlo.layer_body(text)).get("all-gather", {"count": 0})["count"] / len(cfg.layer_pattern)


def _replicate_allgathers() -> float:
    """All-gathers per MoE layer of the `replicate` stage's decode step (the unfused routing gather), at 16
    requests: the count does not depend on the token count (3 at 16 and at 256), the compile is shorter."""
    import jax

    from qwen35_lib import aot
    from qwen35_lib.aot import sweep
    from qwen35_lib.plan import get_stage

    jax.clear_caches()
    cfg = sweep.serving_config(MODEL, 2, **NARROW)
    c = aot.compile_step(cfg, get_stage("replicate"), aot.chip_core_mesh(), requests=16, context_len=CONTEXT,
                         decode=2, page_size=PAGE, kv_dtype="float8_e4m3fn")
    return _allgathers_per_moe_layer(c.as_text(), cfg)


@pytest.fixture(scope="module")
def tpu7x():
    return aot_subprocess.run({"hier_rs": (_schedule, False), "serialised": (_schedule, True),
                               "replicate": (_replicate_allgathers,)}, timeout=570)


def test_the_fused_allgather_is_two_gathers_per_moe_layer_instead_of_three(tpu7x):
    # replicate gathers hidden states, expert ids and weights; hier_rs (fused_ag's routing) ids and weights as one
    assert tpu7x["replicate"] == 3
    assert tpu7x["hier_rs"]["allgathers"] == 2


def test_the_recipe_flags_are_the_public_ironwood_ones():
    from qwen35_lib import aot

    assert aot.RECIPE_OPTIONS == {"xla_tpu_enable_async_collective_merger": "false",
                                  "xla_tpu_ars_combiner_threshold_in_bytes": "0"}


def test_each_moe_layer_has_two_reduce_scatter_phases_per_micro_batch(tpu7x):
    s = tpu7x["hier_rs"]
    assert s["micro_batches"] == s["code_micro_batches"] == 2  # what the code uses for 256 tokens
    assert len(s["chains"]) == s["moe_layers"] * s["micro_batches"]  # one (core, chip) chain per micro-batch
    assert ["reduce-scatter", "sparsecore", 2] in s["how"] and ["reduce-scatter", "sparsecore", 4] in s["how"]


def test_the_next_micro_batch_starts_before_the_previous_phase_2_is_done(tpu7x):
    assert all(tpu7x["hier_rs"]["overlapped"]), tpu7x["hier_rs"]["chains"]


def test_the_serialised_control_does_not_overlap(tpu7x):
    s = tpu7x["serialised"]
    assert len(s["chains"]) == s["moe_layers"] * s["micro_batches"]
    assert not any(s["overlapped"]), s["chains"]
