"""The layout rules: how each general layout places attention, GDN and the MoE on the `('chip', 'core')` mesh, as
data (logical axis -> mesh axes). `qwen35_lib.plan.record.ServingPlan` reads them by its layout's general form.

| layout       | attention / GDN                           | MoE                         | requests (batch) |
|--------------|-------------------------------------------|-----------------------------|------------------|
| `single`     | one device                                | one device                  | one rank         |
| `tp`         | `W_q[D, Hq_x]`, `W_k[D, Hkv_x]`            | `W[E, D, F_x]` + all-reduce  | replicated       |
| `tp_kvrep`   | as `tp`, KV heads duplicated in the weights to max(1, Hkv/tp) per device | as `tp` | replicated |
| `tp_ep`      | as `tp_kvrep`                             | `W[E_x, D, F]` (as `dp_ep`) | replicated       |
| `dp_tp2_ep`  | heads over `core`                         | `W[E_x, D, F]`              | ranks over `chip`|
| `dp_ep`      | replicated weights, own requests          | `W[E_x, D, F]`              | ranks over all   |

(x = every mesh axis, `ALL = ('chip', 'core')`.) `tp_ep` is tpu-inference's TP8_EP (its low-concurrency layout): the
attention and GDN of `tp_kvrep`, the experts of `dp_ep`; with every token on every device, `replicate` routing needs no
all-gather (each device runs its local experts on all tokens, one all-reduce sums them, the shared expert's F/tp
slice with them), and `all_to_all` sends each device's 1/n of the tokens. `tp8`, `tp8_kvrep`, `tp8_ep8`,
`dp4_tp2_ep8` and `dp8_ep8` are the same layouts as 8-device instances (`INSTANCES`): they refuse a mesh of another
size, naming the general form.
"""

from __future__ import annotations

from typing import NamedTuple

from qwen35_lib.plan.mesh import ALL

# 8-device instances, then the general forms (sizes from the mesh)
LAYOUTS = ("single", "tp8", "tp8_kvrep", "tp8_ep8", "dp4_tp2_ep8", "dp8_ep8", "tp", "tp_kvrep", "tp_ep", "dp_tp2_ep",
           "dp_ep")
ROUTINGS = ("replicate", "all_to_all")  # EP layouts: all-gather tokens | send tokens to their experts

Axes = tuple[str, ...] | str | None

_TP_HEADS = (("q_heads", ALL), ("gdn_k_heads", ALL), ("gdn_v_heads", ALL), ("ffn", ALL), ("moe_ffn", ALL),
             ("vocab", ALL), ("kv_heads", ALL))


class LayoutRules(NamedTuple):
    """How one general layout places the model: read by `ServingPlan` through its layout's general form."""

    rules: tuple[tuple[str, Axes], ...]  # (logical axis, mesh axes); axes not named are replicated
    moe: str  # "local" | "tp" (expert FFN split, all-reduce) | "ep" (experts split, routed)
    kv_replicated: bool  # KV heads duplicated in the weights to max(1, Hkv / tp) per device
    summary: str


LAYOUT_RULES: dict[str, LayoutRules] = {  # general layout -> its rules
    "single": LayoutRules((), "local", False, "everything on one device"),
    "tp": LayoutRules(_TP_HEADS, "tp", False,
                      "tensor parallelism over every device: every head axis and the expert FFN split"),
    "tp_kvrep": LayoutRules(_TP_HEADS, "tp", True, "tensor parallelism with the KV heads duplicated in the weights "
                            "so each device keeps the max(1, Hkv/tp) KV heads its query heads read"),
    "tp_ep": LayoutRules(tuple(r for r in _TP_HEADS if r[0] != "moe_ffn") + (("experts", ALL),), "ep", True,
                         "tensor-parallel attention and GDN with the KV heads duplicated as tp_kvrep's, experts over "
                         "every device as dp_ep's (tokens on every device)"),
    "dp_tp2_ep": LayoutRules((("batch", "chip"), ("q_heads", "core"), ("kv_heads", "core"), ("gdn_k_heads", "core"),
                              ("gdn_v_heads", "core"), ("ffn", "core"), ("experts", ALL)), "ep", False,
                             "data-parallel ranks over the chips, heads split over the 2 cores of a chip, experts over "
                             "all"),
    "dp_ep": LayoutRules((("batch", ALL), ("experts", ALL)), "ep", False,
                         "data-parallel ranks over every device (attention and GDN whole per device), experts over "
                         "all"),
}
INSTANCES = {"tp8": "tp", "tp8_kvrep": "tp_kvrep", "tp8_ep8": "tp_ep", "dp4_tp2_ep8": "dp_tp2_ep",
             "dp8_ep8": "dp_ep"}  # 8 devices
GENERAL = {name: INSTANCES.get(name, name) for name in LAYOUTS}  # every layout name -> its general form
assert set(GENERAL.values()) == set(LAYOUT_RULES)


__all__ = ["GENERAL", "INSTANCES", "LAYOUT_RULES", "Axes", "LayoutRules"]
