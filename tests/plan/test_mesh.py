"""The general layouts on 1, 2, 4 and 8 of the simulated devices: the single-device logits and greedy tokens (each
layout on two of the meshes), the sizes the bound plan reads from each mesh, and the 8-device names refusing
another mesh with the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import forward, get_config, init_weights
from qwen35_lib.parallel import placed_config, shard_weights
from qwen35_lib.plan import get_layout, make_mesh

# heads and experts that divide every mesh here: 16 query heads, 2 KV heads (tp_kvrep duplicates them), 16 experts
M2 = get_config("qwen3.5-tiny", dtype="float32", num_q_heads=16, num_kv_heads=2, num_experts=16, head_dim=16)
M8 = M2.replace(num_kv_heads=8)  # `tp` splits KV heads evenly: 8 of them divide every mesh
DEVICES = (1, 2, 4, 8)
# (all_to_all on 4 and 8 devices: test_ep_moves_only_the_rows_routed_to_each_device)
CASES = [("tp", None, M8), ("tp_kvrep", None, M2), ("tp_ep", "replicate", M2), ("dp_tp2_ep", "replicate", M2),
         ("dp_ep", "replicate", M2)]
# numerics: each layout on two meshes, each mesh under two layouts or more (a compile each: 10 of the 20 pairs). On 8
# devices tests/parallel/test_parallelism.py's sized names (tp8_kvrep, tp8_ep8, dp4_tp2_ep8, dp8_ep8) bind the same
# plans as the general names here; `tp` (KV heads split, not duplicated) has no sized name, so it runs on 8 here
MESHES = {"tp": (2, 8), "tp_kvrep": (2, 4), "tp_ep": (1, 4), "dp_tp2_ep": (2, 4), "dp_ep": (1, 4)}
NUMERIC = [(*case, n) for case in CASES for n in MESHES[case[0]]]


@pytest.fixture(scope="module")
def models():
    out = {}
    tokens = np.random.RandomState(1).randint(0, M2.vocab_size, (2, 11)).astype(np.int32)
    for cfg in (M2, M8):
        w = init_weights(cfg, 0)
        out[cfg.num_kv_heads] = (w, np.asarray(forward(cfg, w, tokens, lengths=[11, 6])))
    return tokens, out


def _mesh(n: int):
    return make_mesh(jax.devices()[:n])


@pytest.mark.parametrize("layout,routing,base,devices", NUMERIC,
                         ids=lambda v: v if isinstance(v, str) else "" if v is None or hasattr(v, "name") else str(v))
def test_general_layout_equals_single_device(layout, routing, base, devices, models):
    tokens, ref = models
    weights, want = ref[base.num_kv_heads]
    mesh = _mesh(devices)
    plan = get_layout(layout).replace(routing=routing).bind(mesh, base)
    assert plan.mesh_shape == (("chip", max(1, devices // 2)), ("core", min(2, devices)))
    with jax.set_mesh(mesh):
        out = np.asarray(forward(base, shard_weights(base, plan, weights, mesh), tokens, lengths=[11, 6], plan=plan))
    valid = np.arange(11)[None, :] < np.array([11, 6])[:, None]
    np.testing.assert_allclose(out[valid], want[valid], atol=2e-5, rtol=1e-5)
    assert (out.argmax(-1)[valid] == want.argmax(-1)[valid]).all()  # the greedy tokens


@pytest.mark.parametrize("devices", DEVICES)
def test_sizes_come_from_the_mesh(devices):
    mesh = _mesh(devices)
    sizes = {n: get_layout(n).bind(mesh, M2) for n in ("tp_kvrep", "tp_ep", "dp_tp2_ep", "dp_ep")}
    assert (sizes["dp_ep"].dp, sizes["dp_ep"].ep, sizes["dp_ep"].tp) == (devices, devices, 1)
    assert (sizes["tp_ep"].dp, sizes["tp_ep"].ep, sizes["tp_ep"].tp) == (1, devices, devices)
    assert sizes["tp_ep"].kv_heads_per_device(M2) == sizes["tp_kvrep"].kv_heads_per_device(M2)
    assert (sizes["tp_kvrep"].dp, sizes["tp_kvrep"].tp) == (1, devices)
    assert (sizes["dp_tp2_ep"].dp, sizes["dp_tp2_ep"].tp, sizes["dp_tp2_ep"].ep) == \
           (max(1, devices // 2), min(2, devices), devices)
    # tp_kvrep: each device keeps max(1, Hkv / tp) KV heads; the weights carry Hkv x max(1, tp / Hkv) heads
    rep = sizes["tp_kvrep"]
    assert rep.kv_heads_per_device(M2) == max(1, 2 // devices)
    assert placed_config(M2, rep, mesh).num_kv_heads == 2 * max(1, devices // 2)


def test_eight_device_names_refuse_another_mesh_with_the_general_name():
    for name, general in (("dp8_ep8", "dp_ep"), ("tp8_kvrep", "tp_kvrep"), ("tp8_ep8", "tp_ep"),
                          ("dp4_tp2_ep8", "dp_tp2_ep")):
        with pytest.raises(ValueError, match=f"8-device instance of '{general}'.*4 devices.*use layout '{general}'"):
            get_layout(name).bind(_mesh(4), M2)
        assert get_layout(name).bind(_mesh(8), M2).devices == 8
    with pytest.raises(ValueError, match=r"2 KV heads cannot be split over 4 devices.*'dp_ep'.*'tp_kvrep'"):
        get_layout("tp").bind(_mesh(4), M2)
    with pytest.raises(ValueError, match="12 experts cannot be split evenly over 8"):
        get_layout("dp_ep").bind(_mesh(8), M2.replace(num_experts=12))


@pytest.mark.parametrize("devices", [1, 4, 8])
@pytest.mark.parametrize("routing", ["replicate", "all_to_all"])
def test_ep_moves_only_the_rows_routed_to_each_device(routing, devices, models):
    """Seeded routings of 40 tokens (16 experts, top-3): each device runs only its local copies (replicate) or
    sends each token once per destination device (all_to_all, deduplicated); the counts the code reports equal
    the arithmetic from the routing alone, and the output equals the one-device MoE."""
    from qwen35_lib.model.moe import local_moe, route
    from qwen35_lib.parallel.routing import moe_ep, predicted_rows

    weights, _ = models[1][2]
    w = jax.tree.map(lambda a: a[0, 0], weights["layers"]["moe"])
    cfg = M2
    x = jax.random.normal(jax.random.key(5), (40, M2.hidden_size))
    mesh = _mesh(devices)
    plan = get_layout("dp_ep").replace(routing=routing).bind(mesh, cfg)
    with jax.set_mesh(mesh):
        out, dropped, rows = jax.jit(lambda w, x: moe_ep(cfg, w, x, route, plan, with_rows=True))(w, x)
    ids = np.asarray(route(cfg, w["router"], x)[1])  # [40, 3]
    assert int(dropped) == 0 and np.array_equal(np.asarray(rows), predicted_rows(cfg, plan, ids, devices))
    copies = ids.size
    if routing == "replicate":  # every copy runs on exactly one device: N·k in all, not N·k on each
        assert int(np.sum(rows)) == copies
    else:  # fewer rows than copies once two of a token's experts share a device; never more than the copies
        assert int(np.sum(rows)) < copies
        assert int(np.sum(rows)) == sum(len(set(t // (16 // devices))) for t in ids)
    shared = local_moe(cfg, dict(w, w_down=jnp.zeros_like(w["w_down"])), x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(local_moe(cfg, w, x) - shared), atol=1e-5)
