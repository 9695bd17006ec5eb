"""The notation helper: `W[E_x, D, F]` from a PartitionSpec, and every weight's placement in that notation read
from the same shardings that place the weights (8 simulated devices; nothing is compiled)."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec

from qwen35_lib.config import get_config
from qwen35_lib.parallel import weight_shardings
from qwen35_lib.parallel.notation import notation, weight_notation
from qwen35_lib.plan import ALL, get_layout, make_mesh

MINI = get_config("qwen3.5-mini")


def test_notation_of_a_spec():
    assert notation("x", ("B", "D"), PartitionSpec(ALL, None)) == "x[B_x, D]"
    assert notation("W", ("E", "D", "F"), PartitionSpec(ALL)) == "W[E_x, D, F]"  # trailing dims whole
    assert notation("W_q", ("D", "Hq"), PartitionSpec(None, "core")) == "W_q[D, Hq_core]"
    assert notation("kv", ("R", "P"), PartitionSpec("chip")) == "kv[R_chip, P]"
    assert notation("y", ("N", "D"), PartitionSpec(), unreduced=True) == "{y[N, D]}_U"
    with pytest.raises(ValueError, match="2 entries for 1 dims"):
        notation("b", ("D",), PartitionSpec(ALL, None))


@pytest.mark.parametrize("layout, want", [
    ("tp8_kvrep", {"layers.moe.w_gate_up": "W_gate_up[E, D, 2, F_x]", "layers.moe.w_down": "W_down[E, F_x, D]",
                   "layers.attn.w_k": "W_k[D, Hkv_x, 64]", "embed": "embed[V_x, D]"}),
    ("dp8_ep8", {"layers.moe.w_gate_up": "W_gate_up[E_x, D, 2, F]", "layers.moe.w_down": "W_down[E_x, F, D]",
                 "layers.attn.w_k": "W_k[D, Hkv, 64]", "embed": "embed[V, D]"}),
    ("dp4_tp2_ep8", {"layers.moe.w_down": "W_down[E_x, F, D]", "layers.attn.w_q": "W_q[D, Hq_core, 64]",
                     "layers.gdn.w_v": "W_v[D, Hv_core, 64]"}),
])
def test_weight_notation_reads_the_layouts_shardings(layout, want):
    w = weight_notation(MINI, get_layout(layout), make_mesh())
    assert {k: w[k] for k in want} == want


def test_fp8_experts_are_named_by_their_values_and_every_leaf_is_covered():
    cfg, mesh = MINI.replace(expert_dtype="float8_e4m3fn"), make_mesh()
    plan = get_layout("dp8_ep8").bind(mesh, cfg)
    w = weight_notation(cfg, plan, mesh)
    assert w["layers.moe.w_down"] == "W_down[E_x, F, D]" and not any(k.endswith((".scale", ".value")) for k in w)
    leaves = [k for k in _paths(weight_shardings(cfg, plan, mesh)) if not k.endswith(".scale")]
    assert sorted(w) == sorted(k.removesuffix(".value") for k in leaves)


def _paths(tree) -> list[str]:
    import jax

    from qwen35_lib.parallel.notation import dotted_key

    return [dotted_key(jax.tree_util.keystr(p)) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
