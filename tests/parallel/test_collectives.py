"""parallel.collectives on 8 simulated devices: the hierarchical reduce-scatter equals psum_scatter (in its device
order), returns each device's own tokens gathered in `token_axes` order, its compiled phases, and the fused routing
gather bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from qwen35_lib.parallel import collectives as cc
from qwen35_lib.parallel.collectives import gather_routing, on_each_device, reduce_scatter, reduce_scatter_ops
from qwen35_lib.plan import ALL


def test_hierarchical_reduce_scatter_equals_psum_scatter(mesh):
    x = jax.random.normal(jax.random.key(0), (8 * 48, 5))  # per device [48, 5] partial sums after the shard_map

    def both(x):  # in each device order: the flat twin, and the hierarchical with 2 and 1 micro-batches
        return tuple(f for order in (ALL, cc.HIER_AXES) for f in (
            jax.lax.psum_scatter(x, order, scatter_dimension=0, tiled=True),
            reduce_scatter(x, True, 2, order), reduce_scatter(x, True, 1, order)))

    with jax.set_mesh(mesh):
        out = jax.jit(jax.shard_map(both, in_specs=P(ALL), out_specs=(P(ALL),) * 6))(
            jax.device_put(x, jax.sharding.NamedSharding(mesh, P(ALL))))
    for flat, *hier in (out[:3], out[3:]):
        for h in hier:
            np.testing.assert_allclose(np.asarray(h), np.asarray(flat), rtol=1e-6, atol=1e-6)  # sum order only


def test_gathered_tokens_come_back_to_their_device(mesh):
    # each device's [6, 3] tokens gathered in token_axes order; every device's partial sums xa / 8 summed and
    # scattered must give each device its own tokens back (flat, hierarchical with 1 and 2 micro-batches)
    x = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8, 6, 3)  # [device, tokens, D]
    for hier, m in ((False, 1), (True, 1), (True, 2)):
        back = lambda v, h=hier, m=m: reduce_scatter(cc.all_gather(v, cc.token_axes(h)) / 8, h, m,  # noqa: E731
                                                     cc.token_axes(h))
        np.testing.assert_allclose(on_each_device(back, x, mesh), x, rtol=1e-6)


def test_reduce_scatter_by_hand_and_its_compiled_phases(mesh):
    # rows numbered by the block they belong to; device i (chip c = i // 2, core j = i % 2) must end with block
    # 2c + j in ALL order, j * 4 + c in HIER_AXES order (core major: a scatter over core, then chip, reorders nothing)
    x = np.broadcast_to(np.repeat(np.arange(8.0), 8)[:, None], (64, 4)) * np.ones((8, 1, 1))  # [device, 64, 4]
    for order, want in ((ALL, list(range(8))), (cc.HIER_AXES, [i % 2 * 4 + i // 2 for i in range(8)])):
        for m in (1, 2):
            out = on_each_device(lambda v, m=m, o=order: reduce_scatter(v, True, m, o), x, mesh)
            assert out.shape == (8, 8, 4) and (out[:, 0, 0] / 8).tolist() == want, (order, m)
    rows = [int(op.shape.split("[")[1].split(",")[0]) for op in reduce_scatter_ops(mesh, 2, rows=64, cols=16)]
    assert sorted(rows) == [4, 4, 16, 16]  # per micro-batch: 64 / 2 / 2 after `core`, 64 / 8 / 2 after `chip`


def test_fused_routing_gather_is_bit_exact(mesh):
    ids = jax.random.randint(jax.random.key(1), (8 * 4, 3), 0, 512, jnp.int32)
    w = jax.random.uniform(jax.random.key(2), (8 * 4, 3), jnp.float32).astype(jnp.bfloat16)

    def both(ids, w):
        return (*gather_routing(ids, w, fused=False), *gather_routing(ids, w, fused=True))

    with jax.set_mesh(mesh):
        a_ids, a_w, b_ids, b_w = jax.jit(jax.shard_map(both, in_specs=(P(ALL), P(ALL)),
                                                       out_specs=P(ALL)))(ids, w)
    assert np.array_equal(a_ids, b_ids) and np.array_equal(np.asarray(a_w, np.float32), np.asarray(b_w, np.float32))
