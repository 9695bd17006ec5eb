"""The playbook's notation for a placed array: `W_gate_up[E_x, D, 2, F]`, `x[B_x, D]`, `kv[R_chip, ...]`.

Each dim is a letter; a dim split over mesh axes carries them as a subscript: `_x` for every axis of the mesh
(`ALL = ('chip', 'core')`), else the axis names (`_chip`, `_core`). A dim without a subscript is whole on every
device. A partial sum that still has to be reduced over devices is written `{y[N, D]}_U` (unreduced).

    notation("x", ("B", "D"), PartitionSpec(ALL, None))              # 'x[B_x, D]'
    weight_notation(config, plan, mesh)["layers.moe.w_down"]          # 'W_down[E_x, F, D]' under dp8_ep8

The letters of the weights come from their declared logical axes (`LETTERS`); an axis with no logical name is
written by its size (`2` for the gate|up pair, `256` for a head dim). The stacking dims of the layer loop (group,
position in the group) are left out: every layer of a stack is placed alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import PartitionSpec

from qwen35_lib.config import Config
from qwen35_lib.parallel.shardings import leaf_infos, weight_shardings
from qwen35_lib.plan import ALL, ServingPlan

LETTERS = {"embed": "D", "experts": "E", "moe_ffn": "F", "ffn": "Fs", "q_heads": "Hq", "kv_heads": "Hkv",
           "gdn_k_heads": "Hk", "gdn_v_heads": "Hv", "vocab": "V"}
STACK_DIMS = 2  # [G, P, ...]: layer groups x positions in a group (or GDN / attention layers in a group)


def subscript(axes) -> str:
    """'' (whole), '_x' (every mesh axis) or '_chip' / '_core' for one PartitionSpec entry."""
    if axes is None:
        return ""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return "_x" if names == ALL else "_" + "".join(names)


def notation(name: str, dims: Sequence[str], spec: PartitionSpec, unreduced: bool = False) -> str:
    """`name[d0_s0, d1_s1, ...]` for an array with dim letters `dims` placed by `spec` (trailing dims whole)."""
    if len(spec) > len(dims):
        raise ValueError(f"{name}: the spec {spec} has {len(spec)} entries for {len(dims)} dims {tuple(dims)}")
    entries = list(spec) + [None] * (len(dims) - len(spec))
    body = f"{name}[{', '.join(d + subscript(a) for d, a in zip(dims, entries))}]"
    return f"{{{body}}}_U" if unreduced else body


def weight_notation(config: Config, plan: ServingPlan, mesh) -> dict[str, str]:
    """Every weight of `config` as placed on `mesh` by the serving `plan` (bound here), in the notation:
    `{'layers.moe.w_down': 'W_down[E_x, F, D]', ...}` (FP8 experts: the values, not their block scales)."""
    plan = plan.bound(mesh, config)
    shardings = dict(_flat(weight_shardings(config, plan, mesh)))
    out = {}
    for path, info in leaf_infos(plan.placed(config)):
        key = dotted_key(path)
        if key.endswith(".scale"):
            continue
        key = key.removesuffix(".value")
        stacked = key.startswith("layers.")
        dims = [LETTERS.get(a, str(n)) for a, n in zip(info.logical_axes, info.shape)]
        spec = tuple(shardings[path].spec) + (None,) * (len(dims) - len(shardings[path].spec))
        skip = STACK_DIMS if stacked else 0
        out[key] = notation(_symbol(key), dims[skip:], PartitionSpec(*spec[skip:]))
    return out


def _flat(tree) -> list[tuple[str, object]]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), s) for p, s in flat]


def dotted_key(path: str) -> str:
    """"['layers']['moe']['w_down'].value" -> 'layers.moe.w_down.value'."""
    return path.replace("']['", ".").replace("['", "").replace("']", "").lstrip(".")


def _symbol(key: str) -> str:
    """The array's letter: `W_<name>` for a matrix-like weight leaf (`w_down` -> `W_down`), else its name."""
    leaf = key.rsplit(".", 1)[-1]
    return "W_" + leaf[2:] if leaf.startswith("w_") else leaf


__all__ = ["LETTERS", "notation", "subscript", "weight_notation"]
