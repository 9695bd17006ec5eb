"""Figures of notebook 00: where the parameters are, the layer pattern, and the HBM budget."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from qwen35_lib.budget import HbmBudget
from qwen35_lib.config import FULL, LINEAR, Config
from qwen35_lib.report import PART_ORDER, active_params_by_part
from qwen35_lib.stats import model_stats

GiB = 2**30
COLORS = dict(gdn="#4C72B0", attention="#DD8452", moe="#8C8C8C", weights="#55A868", kv="#C44E52", gdn_state="#8172B2",
              capacity="black")


def plot_param_breakdown(config: Config) -> Figure:
    """Parameters by part (left) and the parameters one token uses (right), in billions."""
    stats = model_stats(config)
    active = active_params_by_part(config, stats)
    parts = [p for p in PART_ORDER if p in stats.params_by_part][::-1]  # largest on top
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, counts, total, title in (
            (axes[0], stats.params_by_part, stats.total_params, "all parameters"),
            (axes[1], active, stats.active_params, "active per token")):
        values = [counts[p] / 1e9 for p in parts]
        ax.barh(parts, values, color=[_part_color(p) for p in parts])
        for y, (p, v) in enumerate(zip(parts, values, strict=True)):
            ax.text(v, y, f" {v:,.2f} B ({counts[p] / total:.1%})", va="center", fontsize=8)
        ax.set_xlim(0, max(values) * 1.45)
        ax.set_xlabel("parameters (billions)")
        ax.set_title(f"{title}: {total / 1e9:,.2f} B")
    fig.suptitle(f"{config.name}: {config.num_experts} routed experts, top-{config.num_experts_per_tok} per token")
    return fig


def _part_color(part: str) -> str:
    return {"routed_experts": COLORS["moe"], "shared_experts": COLORS["moe"], "router": COLORS["moe"],
            "gdn": COLORS["gdn"], "attention": COLORS["attention"]}.get(part, "#937860")


def plot_layer_pattern(config: Config) -> Figure:
    """One column per layer: its token mixer (Gated DeltaNet or gated attention) over its MoE block."""
    types = config.layer_types
    n, p = len(types), len(config.layer_pattern)
    fig = Figure(figsize=(min(max(n * 0.2, 6), 14), 2.6), layout="constrained")
    ax = fig.subplots()
    for i, t in enumerate(types):
        ax.add_patch(Rectangle((i, 1), 0.9, 0.9, color=COLORS["attention" if t == FULL else "gdn"]))
        ax.add_patch(Rectangle((i, 0), 0.9, 0.9, color=COLORS["moe"]))
    for g in range(1, n // p):
        ax.axvline(g * p - 0.05, color="white", lw=2)
    ax.set_xlim(-0.2, n + 0.1)
    ax.set_ylim(-0.1, 2.0)
    ax.set_yticks([0.45, 1.45], ["MoE", "mixer"])
    step = p if n > 16 else 1
    ax.set_xticks([i + 0.45 for i in range(0, n, step)], [str(i) for i in range(0, n, step)])
    ax.set_xlabel("layer")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    gdn, attn = types.count(LINEAR), types.count(FULL)
    fig.legend(handles=[Patch(color=COLORS["gdn"], label=f"Gated DeltaNet ({gdn})"),
                        Patch(color=COLORS["attention"], label=f"gated attention ({attn})"),
                        Patch(color=COLORS["moe"], label=f"MoE: {config.num_experts} experts + shared ({n})")],
               loc="outside lower center", ncol=3, frameon=False, fontsize=8)
    ax.set_title(f"{config.name}: {n // p} x ({config.gdn_per_group} GDN + {config.attn_per_group} attention)")
    return fig


def plot_hbm_budget(budgets: Sequence[HbmBudget], labels: Sequence[str] | None = None) -> Figure:
    """Stacked bars per budget: weights on the devices, KV cache, GDN state, against the memory (black line)."""
    labels = labels or [f"{_short(b.weight_dtypes)}\n{b.concurrency} x {b.context_len:,} tokens" for b in budgets]
    fig = Figure(figsize=(max(2.2 * len(budgets), 6), 4.5), layout="constrained")
    ax = fig.subplots()
    for x, b in enumerate(budgets):
        bottom = 0.0
        for key, value in (("weights", b.weight_bytes_on_devices), ("kv", b.kv_cache_bytes),
                           ("gdn_state", b.gdn_state_bytes)):
            ax.bar(x, value / GiB, bottom=bottom, color=COLORS[key], width=0.6)
            bottom += value / GiB
        usable = b.devices * b.usable_hbm_bytes_per_device / GiB
        ax.hlines(usable, x - 0.4, x + 0.4, color=COLORS["capacity"], lw=2)
        if not b.weights_fit:
            verdict = "weights do not fit"
        elif b.fits:
            verdict = f"fits: {b.left_bytes / GiB:,.0f} GiB left"
        else:
            verdict = f"short by {-b.left_bytes / GiB:,.0f} GiB"
        ax.text(x, max(bottom, usable) * 1.02, verdict, ha="center", va="bottom", fontsize=8,
                color="black" if b.fits else COLORS["kv"])
    ax.set_xticks(range(len(budgets)), labels, fontsize=8)
    ax.set_ylabel("GiB (all devices)")
    top = max(max(b.weight_bytes_on_devices + b.cache_bytes, b.hbm_bytes) for b in budgets) / GiB
    ax.set_ylim(0, top * 1.12)
    fig.legend(handles=[Patch(color=COLORS["weights"], label="weights"), Patch(color=COLORS["kv"], label="KV cache"),
                        Patch(color=COLORS["gdn_state"], label="GDN state"),
                        Patch(color=COLORS["capacity"], label="usable HBM")], loc="outside right upper", fontsize=8)
    ax.set_xlabel(f"weights; requests x tokens held (weights spread: {', '.join(sorted({b.spread for b in budgets}))})")
    hws = sorted({(b.hardware, b.devices, b.usable_hbm_bytes_per_device) for b in budgets})
    ax.set_title("; ".join(f"{h}: {d} x {m / GiB:,.2f} GiB usable" for h, d, m in hws))
    return fig


def _short(dtypes: str) -> str:
    return dtypes.replace("bfloat16", "bf16").replace("float32", "f32").replace("float8_e4m3fn", "FP8")
