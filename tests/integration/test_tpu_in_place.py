"""The kernels stage's engine step compiled for TPU7x-8 reads its weights and caches in place (issue 12, items 3
and 4), at reduced size: Qwen3.5-397B's widths (hidden 4096, expert FFN 1024, its attention and GDN heads) with
FP8 experts and a bf16 GDN state (the serving config), but 64 experts (8 a device) and a 4,096-token vocabulary,
16 requests of 512 tokens in pages of 256 (2 a rank: the properties below do not depend on the count; libtpu
compiled the 2-group step in 24 s at 16 requests, 40 s at 64), a decode step; each compile in `aot_subprocess`'s
child. (At qwen3.5-mini's widths the TPU compiler keeps whole weight stacks in VMEM, a regime the 397B step never sees.)

- No weight copies: the layer loop holds no copy or fusion whose result is an expert weight (FP8 or bf16, with
  the local experts, hidden and expert FFN dims): the Pallas grouped matmul reads the stacked FP8 weights whole,
  the layer's (group, position) scalar-prefetched. The control, the step's MoE layer alone (routed and combined
  over the 8 devices, the same Pallas grouped matmul) in a scan over the same 2 groups of stacks, with the layer's
  slice handed to the kernel as the step did before `LayerOf`, must show such copies (8 of them): the check can
  fail. One MoE layer a group: each layer's Pallas calls are lowered by Mosaic again, so the group's 4 MoE layers
  cost 15 s of compile (24 copies), one 7 s (the whole step as the control compiled in about 40 s).
- Dense projections read in place: the step's passes over its dense weights (`costmodel.compiled.scan_weight_passes`)
  are about 1 with the Pallas projection (`kernels.dense.pallas`, the stacks and the layer's (group, position));
  the control, a step with XLA's dots on the scan's slices, makes more than 2.5: the stored 397B dp_ep decode
  step's text (the same function on it; compiling the reduced step again with `dense_kernel='xla'` cost 33 s).
- Depth (no longer compiled here: the 15-group step cost about 25 s of CI for a strict expected failure; the 397B
  serving shape's temporaries are the sweep's, data/aot/tpu7x-8.json): since the caches became rows of one pool a
  kind (issue 50) the reduced step's temporaries were 0.9348 GB at 2 groups and 0.9507 GB at 15 (+1.7%: at this size
  each layer's whole KV pool fits VMEM and memory-space assignment stages it there around each attention layer, a
  ConcatBitcast of its slices, f8e4m3fn[75,256,1024] at 15 groups; not explained in full). Before: temporaries at 2
  and 15 layer groups agreed within 1%, with the weights placed as the step reads them
  (`aot.mxu_format`: bf16 in 16 x 128 tiles, stacked input projections stored D second-minor; `aot.scale_format`:
  the FP8 block scales in the grouped matmul's layout): 0.9408 / 0.9392 GB at 2 / 15 groups (libtpu 0.0.42.1, 16
  requests; before the one-gather conv, 0.9447 / 0.9438 / 0.9434 GB at 2 / 3 / 15). How it got there, measured at 64
  requests: in the default bf16 tiling (8 x 128) XLA relayouts the whole stacked output projections before the loop
  (1.754 GB at 2 groups, 2.367 GB at 3); in 16 x 128 tiles with the declared dim order the loop copies each group's
  slice of GDN w_v / w_z into D-second-minor order and the heap packs those copies differently at 2 groups (1.134
  GB) than at 3 (1.439 GB) and 15 (1.457 GB); stored D second-minor, 0.967 GB at 2 and 3 groups but 0.986 GB at 15
  (+1.9%: the FP8 scales' whole stacks relaid out before the loop, 1.5 MiB a group); with the scales placed too,
  0.964 GB at 2 groups, 0.962 GB at 15. A scan of 1 group is unrolled, so 2 is the least depth that counts.
- Donation: every cache byte is aliased from the step's input to its output.
- No cache copies: the layer loop holds no copy of a layer's cache pool (`hlo_checks.cache_pool_copies`): each
  layer's pages and slots are rows of its kind's one pool (`model.ragged`). The control, a scan of GDN-state
  updates with each layer's pool sliced out of the stacked cache and written back (the engine's protocol before),
  must show such copies; the same updates as rows of the one pool must not. The XLA attention's FP8 pool (the
  dp_ep stage) is stored as uint32 words (declared so on the TPU mesh; its 397B steps as the sweep compiled them
  copy no pool): the control, a scan of KV row writes and page reads into a pool of FP8 values (`_kv_write_loop`,
  2 s; the whole step with an FP8 pool showed the same 2 relayouts a layer in 26 s), relays the pool out around
  each layer's write; the same loop over words does not.
"""

import pytest

from tests import aot_subprocess

pytestmark = [pytest.mark.tpu_compile, pytest.mark.timeout(600)]  # the fixture: 3 compiles, one child process
MODEL, REQUESTS, CONTEXT, PAGE = "qwen3.5-397b-a17b", 16, 512, 256
REDUCED = {"vocab_size": 4096, "num_experts": 64}
DEPTHS = (2,)  # the depth check at 15 groups: the module doc
CONTROL_LAYERS = 1  # MoE layers a group in the control (module doc)


def _step(groups: int, layouts: str = "mxu") -> dict:
    """The kernels stage's decode step at `groups` layer groups: memory,
    the loop's expert-weight copies, its passes over the dense weights (`costmodel.compiled.scan_weight_passes`)."""
    import dataclasses

    import jax

    from qwen35_lib import aot
    from qwen35_lib.aot import hlo_checks, sweep
    from qwen35_lib.costmodel.compiled import scan_weight_passes
    from qwen35_lib.kernels.moe import pallas as moe_pallas
    from qwen35_lib.parallel.shardings import placed_config
    from qwen35_lib.plan import get_stage

    moe_pallas.moe_pallas.reads_stacked = True  # what the kernels stage does (the control turns it off)
    jax.clear_caches()  # the same config traced again: not from the trace cache
    cfg = sweep.serving_config(MODEL, groups, **REDUCED)
    mesh = aot.chip_core_mesh()
    shape = dataclasses.replace(sweep.SERVING, requests=REQUESTS, context_len=CONTEXT, page_size=PAGE)
    plan = get_stage("kernels").bind(mesh, cfg)
    c = aot.compile_step(cfg, plan, mesh, requests=REQUESTS, context_len=CONTEXT, decode=REQUESTS // 8,
                         page_size=PAGE, kv_dtype=shape.kv_dtype, weight_layouts=layouts)
    ma = c.memory_analysis()
    resident = sweep.resident(cfg, plan, shape, mesh)
    text = c.as_text()
    copies = hlo_checks.expert_weight_copies(text, cfg.num_experts // 8, cfg.hidden_size, cfg.moe_ffn)
    pools = aot.cache_pools(placed_config(cfg, plan, mesh), plan, mesh, sweep.cache_shape(shape, plan, mesh))
    pool_copies = hlo_checks.cache_pool_copies(text, pools)
    return dict(temp=ma.temp_size_in_bytes, alias=ma.alias_size_in_bytes, argument=ma.argument_size_in_bytes,
                cache=resident["kv_bytes"] + resident["gdn_state_bytes"], weights=resident["weight_bytes"],
                copies=[(i.op, i.name, i.arrays) for i in copies], mosaic=_mosaic_slots(text),
                dense_passes=scan_weight_passes(text, cfg, "kernels"),
                pool_copies=[(n, i.op, i.name) for n, i in pool_copies])


def _cache_loop(protocol: str) -> dict:
    """The control for the cache check: a scan over 2 groups of 3 layers, each layer updating 8 slots of its GDN
    state pool [R, 6, NS, 64, 128, 128] (bf16, R = 8 ranks, 1 a device; 3.2 GB a device, far beyond VMEM) and
    all-reducing a scalar (the layer loop is the loop with collectives), under `protocol`: "sliced" (the engine
    before layer rows: the layer's pool sliced out of the stacked cache [R, G, n, ...] and written back) or "rows"
    (`model.ragged`: the layer's slots addressed as rows j*NS + slot of the pool of its kind). The loop's copies."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from qwen35_lib import aot
    from qwen35_lib.aot import hlo_checks
    from qwen35_lib.plan import ALL

    G, n, NS, R = 2, 3, 257, 8
    mesh = aot.chip_core_mesh()
    row = (64, 128, 128)
    pool = jax.ShapeDtypeStruct((R, G * n, NS, *row), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(ALL)))
    slots = jax.ShapeDtypeStruct((R, 8), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(ALL)))

    def update(p, sl):  # one rank's pool [NS', ...] and its 8 slots -> the pool updated, one value a slot
        new = p[sl] * 0.5 + 1  # [8, ...]
        return p.at[sl].set(new), new[:, 0, 0, 0].astype(jnp.float32)

    def step(pool, slots):
        def group(carry, g):
            pool, s = carry
            for i in range(n):
                if protocol == "sliced":
                    stacked = pool.reshape(R, G, n, NS, *row)
                    layer = jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(stacked, g, 1, False), i, 1,
                                                         False)  # [R, NS, ...]
                    layer, seen = jax.vmap(update)(layer, slots)
                    pool = stacked.at[:, g, i].set(layer).reshape(pool.shape)
                else:
                    flat = pool.reshape(R, G * n * NS, *row)
                    flat, seen = jax.vmap(update)(flat, slots + (g * n + i) * NS)
                    pool = flat.reshape(pool.shape)
                s = s + jnp.sum(seen)  # an all-reduce a layer, of rows read before the update
            return (pool, s), None
        return jax.lax.scan(group, (pool, jnp.zeros((), jnp.float32)), jnp.arange(G))[0]

    with jax.set_mesh(mesh):
        text = jax.jit(step, donate_argnums=0).lower(pool, slots).compile().as_text()
    copies = hlo_checks.cache_pool_copies(text, {"state": hlo_checks.PoolOf("bf16", row, NS)})
    return dict(copies=[(n, i.op, i.name) for n, i in copies])


def _sliced_moe_loop() -> dict:
    """The control: the kernels stage's MoE layer (the first `CONTROL_LAYERS` of each group) in a scan over 2
    groups of stacked weights, each layer's slice of the expert stacks handed to the Pallas kernel (`reads_stacked`
    off); the loop's expert-weight copies."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from qwen35_lib import aot
    from qwen35_lib.aot import hlo_checks, sweep
    from qwen35_lib.kernels.moe import pallas as moe_pallas
    from qwen35_lib.model.moe import route, stacked_experts
    from qwen35_lib.parallel.routing import moe_ep
    from qwen35_lib.parallel.shardings import weight_shardings
    from qwen35_lib.plan import ALL, get_stage
    from qwen35_lib.weights import abstract_weights

    moe_pallas.moe_pallas.reads_stacked = False
    jax.clear_caches()
    mesh = aot.chip_core_mesh()
    cfg = sweep.serving_config(MODEL, 2, **REDUCED)
    plan = get_stage("kernels").bind(mesh, cfg)  # the TPU mesh: Pallas kernels lower for Mosaic
    scanned, stacks = stacked_experts(cfg, abstract_weights(cfg, weight_shardings(cfg, plan, mesh))["layers"], plan)
    assert not stacks  # the expert weights stay in the scanned tree: sliced per layer
    x = jax.ShapeDtypeStruct((REQUESTS, cfg.hidden_size), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec(ALL)))  # one decode token a request

    def loop(moe, x):  # moe: leaves [G, P, ...]
        def group(x, w):  # w: leaves [P, ...]
            for p in range(CONTROL_LAYERS):
                x = x + moe_ep(cfg, jax.tree.map(lambda a, p=p: a[p], w), x, route, plan)[0]
            return x, None
        return jax.lax.scan(group, x, moe)[0]

    with jax.set_mesh(mesh):
        text = jax.jit(loop).lower(scanned["moe"], x).compile().as_text()
    copies = hlo_checks.expert_weight_copies(text, cfg.num_experts // 8, cfg.hidden_size, cfg.moe_ffn)
    return dict(copies=[(i.op, i.name, i.arrays) for i in copies])


def _xla_pool() -> str:
    """The dtype of the dp_ep stage's KV pool on the TPU7x mesh (its XLA attention: FP8 stored as uint32 words,
    `attention_xla.kv_words`), as the engine and the sweep declare it; nothing compiled."""
    import dataclasses

    from qwen35_lib import aot
    from qwen35_lib.aot import sweep
    from qwen35_lib.parallel.shardings import placed_config
    from qwen35_lib.plan import get_stage

    cfg = sweep.serving_config(MODEL, 2, **REDUCED)
    mesh = aot.chip_core_mesh()
    shape = dataclasses.replace(sweep.SERVING, requests=REQUESTS, context_len=CONTEXT, page_size=PAGE)
    plan = get_stage("dp_ep").bind(mesh, cfg)
    return aot.cache_pools(placed_config(cfg, plan, mesh), plan, mesh, sweep.cache_shape(shape, plan, mesh))["kv"].dtype


def _kv_write_loop(words: bool) -> dict:
    """The control for the word-stored pool: a scan over 2 groups of 3 layers, each writing 8 tokens' KV rows
    (bf16 [8, 1024] cast to FP8) into its pages of one pool [R, 6 * 64, 256, 1024] (16 MiB a layer a device, 96 in
    all: beyond VMEM) and reading the pages back, as FP8 values or (`words`) as uint32 words; the loop's copies."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from qwen35_lib import aot
    from qwen35_lib.aot import hlo_checks
    from qwen35_lib.kernels.attention.xla import WORD, kv_values, kv_words
    from qwen35_lib.plan import ALL

    G, n, NS, R, P, W, T = 2, 3, 64, 8, 256, 1024, 8
    mesh = aot.chip_core_mesh()
    width, dtype = (W // WORD, jnp.uint32) if words else (W, jnp.float8_e4m3fn)
    sharded = NamedSharding(mesh, PartitionSpec(ALL))
    pool = jax.ShapeDtypeStruct((R, G * n * NS, P, width), dtype, sharding=sharded)
    where = jax.ShapeDtypeStruct((R, T, 2), jnp.int32, sharding=sharded)  # (page, offset) of each token
    new = jax.ShapeDtypeStruct((R, T, W), jnp.bfloat16, sharding=sharded)

    def write(p, wh, x, layer):  # one rank's pool [pages, P, width], T tokens -> the pool written, a value read
        rows = x.astype(jnp.float8_e4m3fn)
        p = p.at[wh[:, 0] + layer * NS, wh[:, 1]].set(kv_words(rows) if words else rows)
        pages = p[wh[:, 0] + layer * NS]  # [T, P, width]
        return p, jnp.sum((kv_values(pages) if words else pages).astype(jnp.float32))

    def step(pool, where, new):
        def group(carry, g):
            pool, s = carry
            for i in range(n):
                pool, seen = jax.vmap(write, in_axes=(0, 0, 0, None))(pool, where, new, g * n + i)
                s = s + jnp.sum(seen)
            return (pool, s), None
        return jax.lax.scan(group, (pool, jnp.zeros((), jnp.float32)), jnp.arange(G))[0]

    with jax.set_mesh(mesh):
        text = jax.jit(step, donate_argnums=0).lower(pool, where, new).compile().as_text()
    kv = hlo_checks.PoolOf("u32" if words else "f8e4m3fn", (P, width), NS)
    return dict(copies=[(k, i.op, i.name) for k, i in hlo_checks.cache_pool_copies(text, {"kv": kv})])


def _mosaic_slots(text: str) -> list[str]:
    """The model slots (attention, gdn, moe) whose ops include a Mosaic kernel (a `tpu_custom_call`)."""
    import re

    calls = [ln for ln in text.splitlines() if 'custom_call_target="tpu_custom_call"' in ln]
    return sorted({m.group(1) for ln in calls if (m := re.search(r'op_name="[^"]*?/(attention|gdn|moe)/', ln))})


@pytest.fixture(scope="module")
def tpu7x():
    """The step at 2 groups and the controls in one child (the controls about 13 s of it on the idle 2-core machine;
    under the 600 s timeout of the first test's setup)."""
    return aot_subprocess.run({f"{g} groups": (_step, g) for g in DEPTHS} | {"sliced": (_sliced_moe_loop,)}
                              | {f"cache {p}": (_cache_loop, p) for p in ("sliced", "rows")}
                              | {"xla pool": (_xla_pool,)}
                              | {f"kv words={w}": (_kv_write_loop, w) for w in (True, False)}, timeout=570)


@pytest.fixture(scope="module")
def sliced(tpu7x):
    return tpu7x["sliced"]


def test_the_control_with_scanned_expert_weights_copies_them(sliced):
    # the scan's slice of each FP8 stack goes to the custom call: XLA copies it every layer (and relays out the
    # whole stack); the check finds them, so it can fail
    assert len(sliced["copies"]) >= 2 * CONTROL_LAYERS, sliced["copies"]  # >= gate_up + down per layer


def test_every_pallas_kernel_of_the_stage_is_a_mosaic_custom_call(tpu7x):
    # the kernels stage on TPU: Pallas attention (its KV write), GDN and MoE, each lowered by Mosaic
    assert tpu7x["2 groups"]["mosaic"] == ["attention", "gdn", "moe"]


def test_no_expert_weight_copies_in_the_layer_loop(tpu7x):
    assert tpu7x["2 groups"]["copies"] == []


def test_the_dense_projections_are_read_in_place(tpu7x):
    # the Pallas projection (`kernels.dense.pallas`) reads each layer's blocks from the stacks: one pass over the
    # dense weights (the per-layer norms and gates still sliced: a few MB). The control, the stored 397B dp_ep step
    # with XLA's dots on the scan's slices, moves them three times or more: the check can fail
    from qwen35_lib.aot.sweep import serving_config
    from qwen35_lib.costmodel import compiled

    assert tpu7x["2 groups"]["dense_passes"] < 1.05, tpu7x["2 groups"]["dense_passes"]
    xla = compiled.scan_weight_passes(compiled.stored_text("dp_ep", "8k/1k decode"), serving_config(MODEL), "dp_ep")
    assert xla > 2.5, xla


def test_the_caches_are_donated_and_updated_in_place(tpu7x):
    for g in DEPTHS:
        s = tpu7x[f"{g} groups"]
        assert s["alias"] >= s["cache"] > 0, s  # every cache buffer is the output's buffer too
        assert s["argument"] >= s["weights"] + s["cache"]


def test_no_cache_pool_copies_in_the_layer_loop(tpu7x):
    # every layer's pages and slots are rows of its kind's pool, written by scatters and aliased kernel outputs
    for g in DEPTHS:
        assert tpu7x[f"{g} groups"]["pool_copies"] == [], tpu7x[f"{g} groups"]["pool_copies"]


def test_the_cache_check_finds_the_sliced_protocol_and_passes_layer_rows(tpu7x):
    # the control: a layer's pool sliced out of the stacked cache and written back is copied every layer (the
    # check can fail); the same updates as rows of one pool copy nothing
    assert len(tpu7x["cache sliced"]["copies"]) >= 3, tpu7x["cache sliced"]
    assert tpu7x["cache rows"]["copies"] == [], tpu7x["cache rows"]


def test_the_xla_attention_writes_its_word_stored_pool_in_place(tpu7x):
    # XLA:TPU scatters rows of an 8-bit pool only after relaying the whole pool out (T(32,128)(4,1) -> T(8,128)
    # and back: 2 copies a layer, the control); stored as uint32 words, the rows are written in place: in the loop
    # (no copies) and in the dp_ep stage's 397B steps as the sweep compiled them (data/aot/tpu7x-8.json's record;
    # compiling the reduced dp_ep step here again cost 27 s of CI)
    from qwen35_lib import data

    assert tpu7x["xla pool"] == "u32"
    stored = data.read_json("aot/tpu7x-8.json")["stages"]["dp_ep"]["steps"]
    assert all(stored[s]["cache_pools_copied"] == [] for s in ("8k/1k decode", "1k/8k decode")), stored.keys()
    assert tpu7x["kv words=True"]["copies"] == [], tpu7x["kv words=True"]
    assert len(tpu7x["kv words=False"]["copies"]) >= 2, tpu7x["kv words=False"]
