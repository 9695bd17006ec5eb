"""Teaching figures, as pure functions (data in, a `Figure` out): the `('chip', 'core')` mesh and its links (the
primer, drawn by notebook 00), all-gather against all-to-all step by step (notebook 03), and what each step of the
ladder saves, component by component (notebook 06).

    plot_mesh(mesh_devices)                 # [[device id per core] per chip], e.g. plan.make_mesh(...).devices
    plot_collective_steps(n_devices=4)      # replication vs dispatch, one panel a step
    plot_ladder_savings({stage: stage_gain(stage), ...})
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

COMPONENT_COLORS = {"attention": "#DD8452", "gdn": "#4C72B0", "cache": "#64B5CD", "moe": "#55A868",
                    "collectives": "#C44E52", "other": "#8C8C8C"}
TOKEN_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def plot_mesh(devices: Sequence[Sequence[int]], ring: bool = True) -> Figure:
    """The `('chip', 'core')` mesh: one box a chip (in the slice's 2 x 2 arrangement), its TensorCores inside with
    their JAX device ids, the core-to-core link inside a chip and the ICI links between chips (each chip has two
    neighbours: a ring). `devices[chip][core]` is the device id at that mesh position."""
    chips = len(devices)
    cols = 2 if chips > 1 else 1
    pos = {c: (c % cols, c // cols) for c in range(chips)}
    if ring and chips == 4:  # ring order around the 2 x 2: 0 -> 1 -> 3 -> 2 -> 0
        pos = {0: (0, 1), 1: (1, 1), 2: (0, 0), 3: (1, 0)}
    fig = Figure(figsize=(6.2, 4.2), layout="constrained")
    ax = fig.subplots()
    w, h, gap = 1.0, 0.62, 0.7
    centers = {}
    for c, (x, y) in pos.items():
        x0, y0 = x * (w + gap), y * (h + gap)
        centers[c] = (x0 + w / 2, y0 + h / 2)
        ax.add_patch(Rectangle((x0, y0), w, h, fill=True, facecolor="#EEF2F8", edgecolor="#4C72B0", lw=1.5))
        ax.text(x0, y0 + h + 0.05, f"chip {c}", ha="left", va="bottom", fontsize=9)  # clear of the links' arrows
        cores = len(devices[c])
        for k, dev in enumerate(devices[c]):
            cx = x0 + (k + 0.5) * w / cores
            ax.add_patch(Rectangle((cx - 0.18, y0 + 0.14), 0.36, 0.34, facecolor="#FFFFFF", edgecolor="#333333"))
            ax.text(cx, y0 + 0.31, f"core {k}\ndev {dev}", ha="center", va="center", fontsize=7)
        if cores == 2:
            ax.annotate("", (x0 + 0.68, y0 + 0.31), (x0 + 0.32, y0 + 0.31),
                        arrowprops=dict(arrowstyle="<->", color="#55A868", lw=1.5))
    links = [(0, 1), (1, 3), (3, 2), (2, 0)] if ring and chips == 4 else [(i, i + 1) for i in range(chips - 1)]
    for a, b in links:
        (xa, ya), (xb, yb) = centers[a], centers[b]
        ax.add_patch(FancyArrowPatch((xa, ya), (xb, yb), arrowstyle="<->", mutation_scale=12, color="#C44E52",
                                     lw=2, shrinkA=38, shrinkB=38))
    ax.plot([], [], color="#C44E52", lw=2, label="ICI link between chips (axis 'chip': a ring)")
    ax.plot([], [], color="#55A868", lw=1.5, label="core-to-core, inside a chip (axis 'core')")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), fontsize=8, ncol=1, frameon=False)
    ax.set_xlim(-0.2, cols * (w + gap) - gap + 0.2)
    ax.set_ylim(-0.2, ((chips + cols - 1) // cols) * (h + gap) - gap + 0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"mesh ('chip': {chips}, 'core': {len(devices[0])}): {chips * len(devices[0])} devices")
    return fig


def plot_collective_steps(routes: Sequence[Sequence[Sequence[int]]] | None = None, n_devices: int = 4,
                          tokens_per_device: int = 2, seed: int = 0) -> Figure:
    """Token replication (all-gather every token to every device) against all-to-all dispatch (each token only to
    the devices of its experts), step by step: each row a strategy, each column a step; a cell a device, a
    coloured square a token of the device it came from. `routes[d][j]`: the devices token j of device d is routed
    to (its experts' devices; notebook 03 passes the real router's); without it, top-2 drawn at random (`seed`)."""
    if routes is None:
        rng = np.random.default_rng(seed)
        routes = [[rng.choice(n_devices, size=2, replace=False).tolist() for _ in range(tokens_per_device)]
                  for _ in range(n_devices)]
    dest = [[sorted(set(int(x) for x in r)) for r in row] for row in routes]
    n, t = len(dest), len(dest[0])
    top = max(len(r) for row in routes for r in row)
    rows_ = (n * t + 3) // 4  # rows of 4 squares a device may need (every token on it)
    floor = 1.5 - 0.2 * rows_  # the bottom of a device's box
    steps = {
        "replicate": [("1. each device holds its own tokens", lambda d: [(d, j) for j in range(t)]),
                      ("2. all-gather: every token on every device", lambda d: [(s, j) for s in range(n)
                                                                               for j in range(t)]),
                      ("3. each device computes its experts' tokens,\nreduce-scatter sends each result home",
                       lambda d: [(s, j) for s in range(n) for j in range(t) if d in dest[s][j]])],
        "all_to_all": [("1. each device holds its own tokens", lambda d: [(d, j) for j in range(t)]),
                       ("2. all-to-all: a token goes only to\nthe devices of its experts",
                        lambda d: [(s, j) for s in range(n) for j in range(t) if d in dest[s][j]]),
                       ("3. experts compute, a second all-to-all\nsends each result home",
                        lambda d: [(d, j) for j in range(t)])],
    }
    fig = Figure(figsize=(max(11, 1.6 * n), 2.6 + 0.45 * rows_), layout="constrained")
    axes = fig.subplots(2, 3)
    for row, (name, panels) in enumerate(steps.items()):
        for col, (title, holds) in enumerate(panels):
            ax = axes[row, col]
            for d in range(n):
                ax.add_patch(Rectangle((d * 1.2, floor), 1.0, 1.6 - floor, facecolor="#F4F4F4", edgecolor="#333333"))
                ax.text(d * 1.2 + 0.5, floor - 0.08, f"dev {d}", ha="center", va="top", fontsize=7)
                for i, (src, j) in enumerate(holds(d)):
                    x, y = d * 1.2 + 0.08 + (i % 4) * 0.22, 1.35 - (i // 4) * 0.2
                    ax.add_patch(Rectangle((x, y), 0.18, 0.18, facecolor=TOKEN_COLORS[src % len(TOKEN_COLORS)],
                                           alpha=1.0 if j == 0 else 0.55))
            ax.set_xlim(-0.1, n * 1.2)
            ax.set_ylim(floor - 0.3, 1.7)
            ax.axis("off")
            ax.set_title(title, fontsize=8)
        moved = sum(src != d for d in range(n) for src, _ in panels[1][1](d))  # copies that left their device
        axes[row, 0].text(-0.3, (floor + 1.6) / 2, f"{name}\n({moved} token\ncopies moved)", ha="right", va="center",
                          fontsize=9, weight="bold")
    fig.suptitle(f"{n} devices, {t} tokens each, top-{top} routing (a colour: the device a token came from)",
                 fontsize=10)
    return fig


def plot_ladder_savings(gains: dict[str, dict], workloads: Sequence[str] = ("8k/1k", "1k/8k")) -> Figure:
    """What each step of the ladder saves, component by component: for each workload a panel, each step a bar of
    the milliseconds per 1,000 tokens it saves per component (`stage_gain`'s `saved_ms_per_1k_tokens`), savings up
    and added costs down, on a symmetric log scale (the kernels' step saves more than the others together)."""
    fig = Figure(figsize=(5.6 * len(workloads), 4.0), layout="constrained")
    stages = list(gains)
    x = np.arange(len(stages))
    for ax, wl in zip(np.atleast_1d(fig.subplots(1, len(workloads))), workloads):
        up, down = np.zeros(len(stages)), np.zeros(len(stages))
        for comp, color in COMPONENT_COLORS.items():
            v = np.array([gains[st][wl]["saved_ms_per_1k_tokens"].get(comp, 0.0) for st in stages])
            pos, neg = np.clip(v, 0, None), np.clip(v, None, 0)
            ax.bar(x, pos, bottom=up, color=color, label=comp)
            ax.bar(x, neg, bottom=down, color=color, hatch="//", edgecolor="white")
            up, down = up + pos, down + neg
        for i, st in enumerate(stages):
            ax.text(i, up[i], f"x{gains[st][wl]['gain']:.2f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(0, color="#333333", lw=0.8)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xticks(x, stages, rotation=30)
        ax.set_ylabel("ms per 1,000 tokens saved (hatched: added)")
        ax.set_title(f"{wl}: what each step saves, by component (predicted)")
    ax.legend(fontsize=7, loc="lower left")
    return fig


__all__ = ["plot_collective_steps", "plot_ladder_savings", "plot_mesh"]
