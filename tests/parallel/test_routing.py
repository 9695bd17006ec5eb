"""Routing's small parts by hand (which copies a device keeps, the all-to-all buffer size, the drops and rows it
predicts), the local experts against the dense twin, and one EP layer on the mesh against it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.model.moe import moe_dense_reference, route, shared_expert
from qwen35_lib.parallel.routing import a2a_cap, local_experts, predicted_drops, predicted_rows, run_layer
from qwen35_lib.plan import SINGLE, ServingPlan

REPLICATE = ServingPlan("ep", "dp_ep", "replicate")
A2A = ServingPlan("ep", "dp_ep", "all_to_all")


def test_a2a_cap_by_hand(tiny):
    cfg, _ = tiny  # k = 3
    assert a2a_cap(cfg, A2A, 10, 8) == 10  # dropless: every token could go to one device
    assert a2a_cap(cfg, A2A.replace(capacity_factor=1.0), 10, 8) == 4  # ceil(10 * 3 / 8)
    assert a2a_cap(cfg, A2A.replace(capacity_factor=100.0), 10, 8) == 10  # never more than n
    assert a2a_cap(cfg, A2A.replace(capacity_factor=1e-3), 10, 8) == 1  # never less than 1


def test_predicted_rows_and_drops_by_hand(tiny):
    cfg, _ = tiny  # 8 experts over ep = 2 devices: experts 0-3 on device 0, 4-7 on device 1; k = 3
    ids = np.array([[0, 1, 4], [5, 6, 7], [0, 2, 3],  # source device 0's 3 tokens
                    [4, 0, 1], [1, 2, 5], [6, 7, 4]])  # source device 1's
    np.testing.assert_array_equal(predicted_rows(cfg, REPLICATE, ids, ep=2), [9, 9])  # copies per owner: ids < 4
    # all_to_all: one row per (token, destination it has an expert on): device 0 sends t0->0, t0->1, t1->1, t2->0
    np.testing.assert_array_equal(predicted_rows(cfg, A2A, ids, ep=2), [4, 5])
    assert predicted_drops(cfg, A2A, ids, ep=2) == 0
    # capacity 1 row per destination: ceil(f * 3 * 3 / 2) = 1 for f = 0.2; device 0 drops t1's 3 copies to
    # device 1 (t0 is first there) and t2's 3 copies to device 0; device 1 drops t4's 2 copies to 0 (t3 first)
    # and t4's 1 and t5's 3 copies to 1
    capped = A2A.replace(capacity_factor=0.2)
    assert a2a_cap(cfg, capped, 3, 2) == 1
    assert predicted_drops(cfg, capped, ids, ep=2) == 3 + 3 + 2 + 1 + 3
    np.testing.assert_array_equal(predicted_rows(cfg, capped, ids, ep=2), [2, 2])


def test_local_experts_sum_to_the_dense_routed_output(tiny):
    """Each quarter of the experts, run on its own copies, sums over the quarters to the dense twin's routed part;
    the all-local (TP) form gives it at once."""
    cfg, w = tiny
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, cfg.hidden_size)), jnp.float32)

    @jax.jit
    def run(moe, x):
        weights, ids = route(cfg, moe["router"], x)
        parts = [local_experts(cfg, SINGLE, moe["w_gate_up"][f:f + 2], moe["w_down"][f:f + 2], x, ids, weights, f, 2)
                 for f in range(0, 8, 2)]
        whole = local_experts(cfg, SINGLE, moe["w_gate_up"], moe["w_down"], x, ids, weights, 0, 8, all_local=True)
        return parts, whole, moe_dense_reference(cfg, moe, x) - shared_expert(moe, x)

    parts, whole, want = run(moe, x)
    np.testing.assert_allclose(sum(parts), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(whole, want, rtol=1e-4, atol=1e-6)
    assert all(np.abs(p).max() > 0 for p in parts)


def test_an_ep_layer_on_the_mesh_is_the_dense_routed_output(tiny, mesh):
    cfg, w = tiny
    x = np.random.default_rng(1).standard_normal((13, cfg.hidden_size)).astype(np.float32)  # 13: padded to 16
    out, dropped = run_layer(cfg, REPLICATE, w, x, mesh)
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    want = np.asarray(moe_dense_reference(cfg, moe, x) - shared_expert(moe, x))
    assert dropped == 0 and out.shape == (13, cfg.hidden_size)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
