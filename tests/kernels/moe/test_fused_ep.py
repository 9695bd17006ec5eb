"""The fused EP MoE kernel (`kernels.moe.fused_ep`: its routed rows fetched and sent home by DMAs from the grouped
matmul) against its XLA twin (`routing.fused_twin`), the dense routed output and the replicate path it replaces, on the
8 simulated devices, the kernel in the TPU interpreter (remote DMAs, semaphores and the device barrier run there)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from qwen35_lib import get_config, init_weights
from qwen35_lib.model.moe import moe_dense_reference, route, shared_expert
from qwen35_lib.parallel.collectives import all_gather, gather_routing
from qwen35_lib.parallel.routing import fused_local_experts, fused_twin, run_layer
from qwen35_lib.plan import ALL, ServingPlan, any_stage, make_mesh

FUSED = ServingPlan("fused", "dp_ep", "replicate", fuse_allgather=True, kernels="pallas", fused_combine=True)
REPLICATE = ServingPlan("ep", "dp_ep", "replicate", fuse_allgather=True)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh()


@pytest.fixture(scope="module")
def sharp():
    """qwen3.5-tiny float32 (8 experts, one a device, k = 3), its router sharpened: some devices get many copies,
    some none."""
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(cfg, 3)
    w["layers"]["moe"]["router"] = w["layers"]["moe"]["router"] * 50
    return cfg, w


def _dense(cfg, w, x):
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    return np.asarray(moe_dense_reference(cfg, moe, x) - shared_expert(moe, x))


def test_fused_layer_off_a_tpu_equals_the_replicate_path_and_the_dense_output(sharp, mesh):
    """moe_ep with fused_combine off a TPU (its XLA twin, `routing.fused_twin`: the copies delivered by one
    reduce-scatter), 13 tokens (padded to 16: padding copies route nowhere), equals the replicate path's local
    combine and reduce-scatter (the kernels stage's) and the dense twin."""
    cfg, w = sharp
    x = np.random.default_rng(1).standard_normal((13, cfg.hidden_size)).astype(np.float32)
    out, dropped = run_layer(cfg, FUSED, w, x, mesh)
    twin, _ = run_layer(cfg, REPLICATE, w, x, mesh)
    assert dropped == 0 and out.shape == (13, cfg.hidden_size)
    np.testing.assert_allclose(out, twin, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, _dense(cfg, w, x), rtol=1e-4, atol=1e-5)


def test_kernel_equals_its_twin_in_row_tiles_of_16_with_padding_tokens(sharp, mesh):
    """The kernel in the TPU interpreter (remote DMAs, semaphores, the device barrier): 64 tokens (8 a device, 192
    sorted copies a device) in row tiles of 16, so each VMEM stage is reused after its sends are waited for; the last
    device's last 3 tokens route nowhere (as moe_ep's padding: never fetched, sent or waited for). Each device's
    received copies, weighted, equal the twin's (`fused_twin`) and the dense output of its real tokens."""
    cfg, w = sharp
    moe = jax.tree.map(lambda a: a[0, 0], w["layers"]["moe"])
    plan = FUSED.bind(mesh, cfg)
    x = np.random.default_rng(2).standard_normal((64, cfg.hidden_size)).astype(np.float32)
    count = cfg.num_experts // 8
    real = np.arange(64) < 61

    def body(x, real, router, wgu, wd):
        weights, ids = route(cfg, router, x)
        ids = jnp.where(real[:, None], ids, cfg.num_experts)  # padding: routed nowhere
        xa = all_gather(x)
        ida, _ = gather_routing(ids, weights, True)
        first = jax.lax.axis_index(ALL) * count
        ok = (ids < cfg.num_experts)[:, :, None]
        weigh = lambda recv: jnp.einsum("nkd,nk->nd", jnp.where(ok, recv.reshape(*recv.shape[:2], -1), 0), weights)
        kernel = fused_local_experts(cfg, plan, wgu, wd, xa, ida, first, count, ids, tm=16)  # [n, k, 1, D]
        twin = fused_twin(cfg, plan, wgu, wd, xa, ida, first, count, ids)
        return weigh(kernel), weigh(twin)

    with jax.set_mesh(mesh):
        run = jax.jit(jax.shard_map(body, in_specs=(P(ALL), P(ALL), P(), P(ALL), P(ALL)), out_specs=(P(ALL), P(ALL)),
                                    check_vma=False))
        out, twin = (np.asarray(a) for a in run(jnp.asarray(x), jnp.asarray(real), moe["router"], moe["w_gate_up"],
                                                  moe["w_down"]))
    np.testing.assert_allclose(out, twin, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[real], _dense(cfg, w, x)[real], rtol=1e-4, atol=1e-5)
    assert np.all(out[~real] == 0)


def test_fused_combine_is_refused_where_there_is_no_reduce_scatter_to_replace(mesh):
    cfg = get_config("qwen3.5-tiny")
    with pytest.raises(ValueError, match="fused_combine .* routing 'replicate'; got layout 'dp_ep', routing 'all_"):
        ServingPlan("x", "dp_ep", "all_to_all", fused_combine=True).bind(mesh, cfg)
    with pytest.raises(ValueError, match="fused_combine .* got layout 'tp8_ep8'"):
        ServingPlan("x", "tp8_ep8", "replicate", fused_combine=True).bind(mesh, cfg)
    with pytest.raises(ValueError, match="replaces the reduce-scatter: set hierarchical_rs=False"):
        ServingPlan("x", "dp_ep", "replicate", hierarchical_rs=True, fused_combine=True).bind(mesh, cfg)
    fused = any_stage("fused_ep").bind(mesh, cfg)
    assert fused.fused_combine and not fused.hierarchical_rs and fused.fuse_allgather
