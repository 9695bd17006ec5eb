"""Figures of notebook 06 (the cost model) and its explorer, as pure functions: data in, a Figure out.

Every plot takes the dicts that `qwen35_lib.costmodel` returns (`ladder` rows, `validate` rows), so it runs headless
and in tests. `explorer()` wraps `explore()` and `explore_ladder()` (pure functions: choices and assumption values
in, (text, Figure) out) in ipywidgets, with a slider per labelled assumption (`range_assumptions()`).
`layouts_view()` / `layouts_explorer()` (notebook 02): every layout's time per token by mechanism at one concurrency
(`costmodel.choice.layout_mechanisms`), and a concurrency slider over it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

GROUPS = {  # breakdown components, grouped for the stacked bars
    "attention": ("attn_proj", "attn_core"), "GDN": ("gdn_proj", "gdn_core", "gdn_conv"),
    "cache copies": ("cache_copies",), "routed experts": ("routed_experts", "expert_scales"),
    "shared expert + router": ("shared_expert", "router"),
    "permute and row bookkeeping": ("permute", "onehot_permute", "moe_rows"),
    "norms, glue, head, sampling": ("norms", "glue", "embed_lm_head", "sampling"),
    "collectives": ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"), "host": ("host",),
}
COLORS = ["#DD8452", "#4C72B0", "#64B5CD", "#8C8C8C", "#55A868", "#937860", "#DA8BC3", "#C44E52", "#CCB974"]


def _by_workload(rows: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["workload"], []).append(r)
    return out


def plot_ladder(rows: Sequence[dict], reported: dict[str, float] | None = None) -> Figure:
    """Predicted total tokens/s per stage, one panel per workload; each bar labelled with its gain over baseline.
    `reported` ({workload: ratio}) draws the reported end-to-end ratio as a dashed line at baseline x ratio."""
    groups = _by_workload(rows)
    fig = Figure(figsize=(5.5 * len(groups), 3.8), layout="constrained")
    for ax, (wl, rs) in zip(np.atleast_1d(fig.subplots(1, len(groups))), groups.items()):
        rs = [r for r in rs if r.get("fits")]
        vals = [r["total_tokens_per_s"] / 1e3 for r in rs]
        ax.bar([r["stage"] for r in rs], vals, color="#4C72B0")
        for i, r in enumerate(rs):
            ax.text(i, vals[i], f"x{r['vs_baseline']:.2f}", ha="center", va="bottom", fontsize=8)
        if reported and wl in reported and rs:
            ax.axhline(vals[0] * reported[wl], ls="--", color="#C44E52", label=f"reported x{reported[wl]}")
            ax.legend(fontsize=8, loc="upper left")
        ax.set_ylabel("total tokens/s (thousands)")
        ax.set_title(f"{wl}, {rs[0]['concurrency'] if rs else ''} concurrent (predicted)")
        ax.tick_params(axis="x", rotation=30)
    return fig


def plot_breakdown(rows: Sequence[dict]) -> Figure:
    """The mean step's time by component group, stacked, per stage and workload."""
    groups = _by_workload(rows)
    fig = Figure(figsize=(5.5 * len(groups), 3.8), layout="constrained")
    for ax, (wl, rs) in zip(np.atleast_1d(fig.subplots(1, len(groups))), groups.items()):
        rs = [r for r in rs if r.get("fits")]
        bottom = np.zeros(len(rs))
        for (name, parts), color in zip(GROUPS.items(), COLORS):
            v = np.array([sum(r["breakdown_s"].get(p, 0.0) for p in parts) * 1e3 for r in rs])
            ax.bar([r["stage"] for r in rs], v, bottom=bottom, color=color, label=name)
            bottom += v
        ax.set_ylabel("mean step (ms, per device)")
        ax.set_title(f"{wl}: where a step's time goes (predicted)")
        ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=7, loc="upper right")
    return fig


def plot_roofline(rows: Sequence[dict]) -> Figure:
    """Each stage's throughput as a fraction of the roofline bound of the same schedule."""
    groups = _by_workload(rows)
    fig = Figure(figsize=(6, 3.4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(len(groups), 1)
    for i, (wl, rs) in enumerate(groups.items()):
        rs = [r for r in rs if r.get("fits")]
        x = np.arange(len(rs)) + i * width
        ax.bar(x, [r["fraction_of_roofline"] for r in rs], width, label=wl)
        ax.set_xticks(np.arange(len(rs)) + width * (len(groups) - 1) / 2, [r["stage"] for r in rs], rotation=30)
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of the roofline bound")
    ax.legend(fontsize=8)
    ax.set_title("how close each stage comes to what the hardware allows")
    return fig


def plot_cpu_validation(rows: Sequence[dict], band: float = 1.5) -> Figure:
    """Predicted vs measured step seconds on this CPU (log-log), with the x`band` corridor."""
    fig = Figure(figsize=(4.8, 4.2), layout="constrained")
    ax = fig.subplots()
    m = np.array([r["measured_s"] for r in rows]) * 1e3
    p = np.array([r["predicted_s"] for r in rows]) * 1e3
    ax.scatter(m, p, color="#4C72B0", zorder=3)
    for r, x, y in zip(rows, m, p):
        ax.annotate(r["case"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    lo, hi = min(m.min(), p.min()) / 2, max(m.max(), p.max()) * 2
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs / band, xs * band, color="#55A868", alpha=0.2, label=f"within {band}x")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step (ms, CPU)",
           ylabel="predicted step (ms)", title="(a) engine steps on this CPU")
    ax.legend(fontsize=8)
    return fig


def plot_ratios(rows: Sequence[dict], keys: Sequence[str], label: str, title: str) -> Figure:
    """Bars of predicted / measured ratios (`keys` of each row), a line at 1."""
    fig = Figure(figsize=(6, 3.2), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(keys)
    for i, k in enumerate(keys):
        ax.bar(np.arange(len(rows)) + i * width, [r[k] for r in rows], width, label=k)
    ax.set_xticks(np.arange(len(rows)) + width * (len(keys) - 1) / 2, [r[label] for r in rows], fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("predicted / measured")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_sensitivity(sweeps: dict[str, list[tuple[float, float, float]]]) -> Figure:
    """Gain of the whole ladder (kernels over baseline) as each labelled assumption is scaled.
    `sweeps`: {assumption: [(scale, prefill-heavy gain, decode-heavy gain), ...]}."""
    fig = Figure(figsize=(10, 3.4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=False)
    for name, pts in sweeps.items():
        s = [p[0] for p in pts]
        axes[0].plot(s, [p[1] for p in pts], marker="o", label=name)
        axes[1].plot(s, [p[2] for p in pts], marker="o", label=name)
    for ax, t in zip(axes, ("8k/1k (prefill-heavy)", "1k/8k (decode-heavy)")):
        ax.set(xscale="log", xlabel="assumption x scale", ylabel="kernels / baseline", title=t)
    axes[1].legend(fontsize=7)
    return fig


def range_assumptions() -> dict[str, dict]:
    """{name: record} of the labelled assumptions with a free value (kind 'range': value, low, high, source)."""
    from qwen35_lib.costmodel.assumptions import records

    return {k: r for k, r in records().items() if r["kind"] == "range"}


def mechanisms(values: dict[str, float] | None = None):
    """`Mechanisms.nominal()` with the assumptions in `values` changed (None or {}: the nominal)."""
    from qwen35_lib.costmodel.assumptions import Mechanisms

    return Mechanisms.nominal(**(values or {}))


def explore(model: str = "qwen3.5-397b-a17b", hardware: str = "tpu7x-8", stage: str = "kernels",
            concurrency: int = 512, isl: int = 8192, osl: int = 1024,
            assumptions: dict[str, float] | None = None) -> tuple[str, Figure | None]:
    """One prediction as (text, breakdown figure) -- the explorer's body, testable headless. `assumptions`:
    {name: value} of `range_assumptions()` replacing their nominal values."""
    from qwen35_lib.costmodel import predict

    r = predict(model, hardware, stage, isl, osl, concurrency, mechanisms=mechanisms(assumptions))
    if not r["fits"]:
        return f"{model} on {hardware}: does not fit. {r['reason']}", None
    text = (f"{model} on {hardware}, {stage}: {r['output_tokens_per_s']:,.0f} output tok/s, "
            f"{r['total_tokens_per_s']:,.0f} total tok/s ({r['total_tokens_per_s_per_chip']:,.0f} per chip); "
            f"mean step {r['mean_step_s'] * 1e3:.1f} ms; {r['fraction_of_roofline']:.0%} of the roofline bound")
    fig = Figure(figsize=(6, 3), layout="constrained")
    ax = fig.subplots()
    items = sorted(((k, v * 1e3) for k, v in r["breakdown_s"].items() if v > 0), key=lambda kv: kv[1])
    ax.barh([k for k, _ in items], [v for _, v in items], color="#4C72B0")
    ax.set_xlabel("ms per step (per device)")
    ax.set_title("step-time breakdown (predicted)")
    return text, fig


def explore_ladder(model: str = "qwen3.5-397b-a17b", hardware: str = "tpu7x-8", concurrency: int = 512,
                   isl: int = 8192, osl: int = 1024, assumptions: dict[str, float] | None = None
                   ) -> tuple[list[dict], Figure]:
    """Every stage of the ladder for one workload and concurrency (`costmodel.ladder`, no roofline run): the rows
    and `plot_ladder`'s bars (total tokens/s, each labelled with its gain over baseline)."""
    from qwen35_lib.costmodel import ladder

    rows = ladder(model, hardware, ((isl, osl),), concurrency, google_baseline=False, roofline=False,
                  mechanisms=mechanisms(assumptions))
    return rows, plot_ladder(rows)


def ladder_text(rows: Sequence[dict]) -> str:
    """One line per stage: total tokens/s, mean step, gain over the stage before and over baseline."""
    return "\n".join(f"{r['stage']:<10} {r['total_tokens_per_s']:>10,.0f} total tok/s  mean step "
                     f"{r['mean_step_s'] * 1e3:7.2f} ms  x{r['gain']:.2f} over the previous, x{r['vs_baseline']:.2f} "
                     "over baseline" if r.get("fits") else f"{r['stage']:<10} does not fit: {r['reason']}"
                     for r in rows)


def tooltip(widget_class: type, text: str) -> dict[str, str]:
    """The keyword that gives a widget its hover text in the ipywidgets installed: `tooltip` from ipywidgets 8,
    `description_tooltip` before (Colab's runtime brings ipywidgets 7, and the notebooks' install line leaves it:
    7 would take `tooltip` as an unknown argument, warn and drop it)."""
    return {"tooltip" if widget_class.class_traits().get("tooltip") else "description_tooltip": text}


def explorer():
    """ipywidgets: model preset, hardware, stage, concurrency, input and output lengths, and a slider per labelled
    assumption (its low-high range, nominal to start; the tooltip says what it changes) -> `explore` (the chosen
    stage's breakdown) and `explore_ladder` (every stage, bars)."""
    import ipywidgets as w
    from IPython.display import display

    from qwen35_lib.config import PRESETS
    from qwen35_lib.costmodel import specs
    from qwen35_lib.plan import LADDER

    controls = dict(
        model=w.Dropdown(options=list(PRESETS), value="qwen3.5-397b-a17b", description="model"),
        hardware=w.Dropdown(options=[n for n in specs.names() if n != "cpu"], value="tpu7x-8", description="hardware"),
        stage=w.Dropdown(options=list(LADDER), value="kernels", description="stage"),
        concurrency=w.IntSlider(value=512, min=1, max=1024, step=1, description="concurrency",
                                continuous_update=False),
        isl=w.IntText(value=8192, description="input len"), osl=w.IntText(value=1024, description="output len"))
    style = {"description_width": "14em"}
    sliders = {name: w.FloatSlider(value=r["value"], min=r["low"], max=r["high"], step=(r["high"] - r["low"]) / 50,
                                   readout_format=".4g", description=name, continuous_update=False, style=style,
                                   layout=w.Layout(width="34em"), **tooltip(w.FloatSlider, r["mechanism"][:300]))
               for name, r in range_assumptions().items()}
    out, ladder_out = w.Output(), w.Output()

    def update(_=None):
        choice = {k: c.value for k, c in controls.items()}
        values = {k: c.value for k, c in sliders.items()}
        for box, body in ((out, lambda: explore(**choice, assumptions=values)),
                          (ladder_out, lambda: _ladder_view(choice, values))):
            box.clear_output(wait=True)
            with box:
                try:
                    text, fig = body()
                except ValueError as e:
                    text, fig = f"error: {e}", None
                print(text)
                if fig is not None:
                    display(fig)

    for c in [*controls.values(), *sliders.values()]:
        c.observe(update, names="value")
    update()
    names = list(sliders.values())
    assumptions = w.VBox([w.HTML("<b>labelled assumptions</b> (data/costmodel_assumptions.json: each slider spans "
                                 "its recorded low-high range, starting at its nominal value)"),
                          *[w.HBox(names[i:i + 2]) for i in range(0, len(names), 2)]])
    return w.VBox([w.HBox(list(controls.values())[:3]), w.HBox(list(controls.values())[3:]), assumptions, out,
                   w.HTML("<b>the ladder</b>: every stage for this workload and concurrency"), ladder_out])


def _ladder_view(choice: dict, values: dict) -> tuple[str, Figure]:
    rows, fig = explore_ladder(choice["model"], choice["hardware"], choice["concurrency"], choice["isl"],
                               choice["osl"], values)
    return ladder_text(rows), fig


LAYOUT_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def layouts_view(concurrency: int = 64, isl: int = 8192, osl: int = 1024, engine: str = "tpu-inference",
                 kernels: str = "pallas") -> tuple[str, Figure]:
    """Every layout at one concurrency as (text, figure): stacked bars of its ms per 1,000 tokens by mechanism
    (`choice.layout_mechanisms`: dense weights, KV reads, GDN state, collectives, routed experts, other), the
    shortest bar the layout `predict --layout auto` serves."""
    from qwen35_lib.costmodel.choice import MECHANISMS, layout_mechanisms

    rows = layout_mechanisms(isl=isl, osl=osl, concurrency=concurrency, kernels=kernels, engine=engine)
    best = min(rows, key=lambda k: rows[k]["total"])
    text = f"c{concurrency}, {isl}/{osl}, priced as {engine} engine: ms per 1,000 tokens (served: {best})\n" + \
        "\n".join(f"  {lay:<12} total {parts['total']:8.2f}  " + "  ".join(f"{k} {parts[k]:.2f}" for k in parts
                                                                        if k != "total") for lay, parts in rows.items())
    fig = Figure(figsize=(6.4, 3), layout="constrained")
    ax = fig.subplots()
    names = list(rows)
    left = np.zeros(len(names))
    for color, part in zip(COLORS, [*MECHANISMS, "other"]):
        vals = np.array([rows[n][part] for n in names])
        ax.barh(names, vals, left=left, color=color, label=part)
        left += vals
    ax.set_xlabel("ms per 1,000 tokens (whole slice)")
    ax.set_title(f"where each layout's time goes at {concurrency} requests ({isl}/{osl})")
    ax.legend(fontsize=7, loc="lower right")
    return text, fig


def layouts_explorer(isl: int = 8192, osl: int = 1024):
    """ipywidgets: a concurrency slider (c1 ... c512), the workload's lengths and whose engine prices it ->
    `layouts_view`."""
    import ipywidgets as w
    from IPython.display import display

    from qwen35_lib.costmodel.choice import ENGINES

    controls = dict(concurrency=w.SelectionSlider(options=list(LAYOUT_CONCURRENCIES), value=64,
                                                  description="concurrency", continuous_update=False),
                    isl=w.IntText(value=isl, description="input len"),
                    osl=w.IntText(value=osl, description="output len"),
                    engine=w.Dropdown(options=list(ENGINES), value="tpu-inference", description="engine"))
    out = w.Output()

    def update(_=None):
        out.clear_output(wait=True)
        with out:
            try:
                text, fig = layouts_view(**{k: c.value for k, c in controls.items()})
            except ValueError as e:
                text, fig = f"error: {e}", None
            print(text)
            if fig is not None:
                display(fig)

    for c in controls.values():
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox(list(controls.values())[:2]), w.HBox(list(controls.values())[2:]), out])
