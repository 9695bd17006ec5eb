"""per_rank: a vmap over the data-parallel rank axis, in a shard_map where a kernel must run per device, and the
refusal of a Pallas kernel under a layout that also splits heads."""

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


def test_a_pallas_kernel_under_a_layout_splitting_heads_is_refused_with_the_fix(mesh):
    plan = get_layout("dp4_tp2_ep8").replace(gdn_kernel="pallas").bind(mesh)
    with pytest.raises(ValueError, match=r"Pallas gdn kernel runs per data-parallel rank; layout 'dp4_tp2_ep8' also "
                                         r"splits heads.*'dp_ep'.*gdn_kernel='xla'"):
        per_rank(CFG, "gdn", _rank_fn, *_args(), plan=plan)
