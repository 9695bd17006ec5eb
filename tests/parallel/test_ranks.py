"""per_rank: a vmap over the data-parallel rank axis, in a shard_map where a kernel must run per device: of ranks,
or of ranks and heads where a layout also splits heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import get_config
from qwen35_lib.parallel.ranks import per_rank
from qwen35_lib.plan import SINGLE, get_layout

CFG = get_config("qwen3.5-tiny", dtype="float32")


def _rank_fn(x, scale):  # one rank's work: x [T, D], scale [] -> [T, D]
    return jnp.cumsum(x, axis=0) * scale


def _args():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((8, 3, 4)), jnp.float32), jnp.arange(8, dtype=jnp.float32)


def _expected(x, scale):
    return np.cumsum(np.asarray(x), axis=1) * np.asarray(scale)[:, None, None]


def test_single_device_is_a_vmap_over_ranks():
    x, s = _args()
    np.testing.assert_allclose(per_rank(CFG, "attention", _rank_fn, x, s, plan=SINGLE), _expected(x, s), rtol=1e-6)


@pytest.mark.parametrize("slot,kernel,shard_mapped", [("attention", "xla", True), ("gdn", "pallas", True),
                                                      ("gdn", "xla", False)])
def test_dp_ep_runs_each_devices_ranks_in_a_shard_map(mesh, slot, kernel, shard_mapped):
    """Every mesh axis splits ranks under dp_ep: a Pallas kernel, and the XLA attention, run per device; the XLA
    GDN stays partitioned by XLA. The per-rank results are the vmap's either way."""
    field = {"attention": "attention_kernel", "gdn": "gdn_kernel"}[slot]
    plan = get_layout("dp_ep").replace(**{field: kernel}).bind(mesh)
    x, s = _args()
    call = lambda x, s: per_rank(CFG, slot, _rank_fn, x, s, plan=plan)  # noqa: E731
    with jax.set_mesh(mesh):
        assert ("shard_map" in str(jax.make_jaxpr(call)(x, s))) == shard_mapped
        np.testing.assert_allclose(jax.jit(call)(x, s), _expected(x, s), rtol=1e-6)


def _heads_fn(q, states):  # one rank's GDN-like work: q [T, H, d], states [NS, H, dk, dv]; heads independent
    return q * 2 + jnp.sum(states, axis=(0, 3))[None, :, :q.shape[-1]], states + 1


@pytest.mark.parametrize("layout", ["tp_kvrep", "dp_tp2_ep"])
def test_a_pallas_kernel_under_a_layout_splitting_heads_runs_on_each_devices_heads(mesh, layout):
    """tp_kvrep (google_baseline's layout: one rank, heads over every device) and dp_tp2_ep (ranks over chips, heads
    over cores): the Pallas slot's call runs in a shard_map of ranks and heads, and gives the vmap's result."""
    plan = get_layout(layout).replace(gdn_kernel="pallas").bind(mesh, CFG)
    R = plan.dp_size(mesh)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((R, 3, 8, 4)), jnp.float32)  # [R, T, H, d]
    states = jnp.asarray(rng.standard_normal((R, 2, 8, 4, 4)), jnp.float32)  # [R, NS, H, dk, dv]
    call = lambda q, st: per_rank(CFG, "gdn", _heads_fn, q, st, plan=plan)  # noqa: E731
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(call)(q, states))
        got = jax.jit(call)(q, states)
    for g, w in zip(got, jax.vmap(_heads_fn)(q, states)):
        np.testing.assert_allclose(g, w, rtol=1e-6)
