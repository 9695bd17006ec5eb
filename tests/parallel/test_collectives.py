"""parallel.collectives on 8 simulated devices: the hierarchical reduce-scatter equals psum_scatter, its compiled
phases, and the fused routing gather bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from qwen35_lib.parallel.collectives import gather_routing, on_each_device, reduce_scatter, reduce_scatter_ops
from qwen35_lib.plan import ALL


def test_hierarchical_reduce_scatter_equals_psum_scatter(mesh):
    x = jax.random.normal(jax.random.key(0), (8 * 48, 5))  # per device [48, 5] partial sums after the shard_map

    def both(x):
        return (jax.lax.psum_scatter(x, ALL, scatter_dimension=0, tiled=True),
                reduce_scatter(x, hierarchical=True, micro_batches=2), reduce_scatter(x, hierarchical=True,
                                                                                      micro_batches=1))

    with jax.set_mesh(mesh):
        flat, hier, hier1 = jax.jit(jax.shard_map(both, in_specs=P(ALL), out_specs=(P(ALL),) * 3))(
            jax.device_put(x, jax.sharding.NamedSharding(mesh, P(ALL))))
    np.testing.assert_allclose(np.asarray(hier), np.asarray(flat), rtol=1e-6, atol=1e-6)  # sum order only
    np.testing.assert_allclose(np.asarray(hier1), np.asarray(flat), rtol=1e-6, atol=1e-6)


def test_reduce_scatter_by_hand_and_its_compiled_phases(mesh):
    # every device holds rows numbered by the block they belong to; device (chip c, core j) must end with block 2c + j
    x = np.broadcast_to(np.repeat(np.arange(8.0), 8)[:, None], (64, 4)) * np.ones((8, 1, 1))  # [device, 64, 4]
    for m in (1, 2):
        out = on_each_device(lambda v, m=m: reduce_scatter(v, hierarchical=True, micro_batches=m), x, mesh)
        assert out.shape == (8, 8, 4) and (out[:, 0, 0] / 8).tolist() == list(range(8))
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
