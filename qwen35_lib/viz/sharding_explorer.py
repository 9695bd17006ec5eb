"""The sharding explorer: what each device holds under a layout, and whether it fits, as a figure and a widget.

    placement_figure(placement(config, "dp8_ep8"))     # a matplotlib Figure, headless
    step_collectives(config, "dp8_ep8", 8, "replicate")  # {step: {kind: (ops, bytes)}} per device, the cost model's
    sharding_explorer()                                 # an ipywidgets box: the controls below, memory, collectives

The widget's summary is an `ipywidgets.HTML` holding `<div class="qwen35-explorer-summary">` (then the collectives
table, `<div class="qwen35-explorer-collectives">`), and its controls have stable descriptions ("model", "layout",
"devices", "hardware", "KV dtype", "expert dtype", "GDN state", "context", "requests", "routing"), so a browser
test can find them.
"""

from __future__ import annotations

import base64
import html
import io

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from qwen35_lib import hardware as hw
from qwen35_lib.config import EXPERT_DTYPES, PRESETS, Config, get_config
from qwen35_lib.costmodel import traffic
from qwen35_lib.costmodel.predict import token_budget
from qwen35_lib.placement import Placement, fmt_range, placement
from qwen35_lib.plan import LAYOUTS, ROUTINGS, abstract_mesh, custom_stage, get_layout
from qwen35_lib.viz.architecture import COLORS, GiB

SUMMARY_CLASS = "qwen35-explorer-summary"
COLLECTIVES_CLASS = "qwen35-explorer-collectives"
LABELS = dict(q_heads="query heads", kv_heads="KV heads", gdn_k_heads="GDN key heads", gdn_v_heads="GDN value heads",
              experts="experts", moe_ffn="expert FFN cols", requests="requests")
BARS = (("routed experts", "routed experts", COLORS["moe"]), ("attention", "attention weights", COLORS["attention"]),
        ("GDN", "GDN weights", COLORS["gdn"]), ("other", "embed, lm_head, shared, norms", "#937860"),
        ("kv", "KV cache", COLORS["kv"]), ("gdn_state", "GDN state", COLORS["gdn_state"]))
MODEL_DTYPE = "model dtype"  # a dropdown's value for None (a None value shows as no selection)
KV_DTYPES = (MODEL_DTYPE, "float8_e4m3fn")
EXPERT_DTYPE_OPTIONS = tuple(d or MODEL_DTYPE for d in EXPERT_DTYPES)
GDN_DTYPES = ("float32", "bfloat16")  # the Config's default; tpu-inference's (the serving setup)
DEVICE_COUNTS = (1, 2, 4, 8, 16)
CONTEXT_LENS = tuple(1024 << i for i in range(9))  # 1k .. 256k tokens per request
STEPS = ("decode", "prefill")
BROKEN_ROW = (("KV heads cannot", "kv_heads"), ("experts cannot", "experts"), ("expert FFN", "moe_ffn"),
              ("FP8 expert scales", "moe_ffn"))  # substring of the refusal -> the row drawn red


def placement_figure(p: Placement) -> Figure:
    """Devices as columns: what each holds (top) and its memory against the HBM line (bottom).

    1. top: one row per axis (query heads, KV heads, GDN heads, experts, expert FFN, requests), one cell per device
       with the indices it holds; blue when the axis is split (devices hold different indices), red for the axis
       whose rule a refused layout breaks (drawn with `spec`'s fallback: replicated);
    2. bottom: stacked bars per device (routed experts, attention, GDN, other weights, KV cache, GDN state) in GiB,
       with the device's HBM as a black line;
    3. title: the verdict (fits / does not fit / refused, with the rule that breaks).
    """
    n = p.devices
    fig = Figure(figsize=(max(8.0, 1.15 * n + 3.0), 7.0), layout="constrained")
    top, bottom = fig.subplots(2, 1, height_ratios=(1.1, 1.0))
    rows = [k for k in LABELS if k in p.per_device[0].holds]
    broken = {row for key, row in BROKEN_ROW if p.problem and key in p.problem}
    for y, key in enumerate(rows):
        split = len({p.per_device[d].holds[key] for d in range(n)}) > 1
        color = "#F4CCCC" if key in broken else "#DCE6F2" if split else "#F2F2F2"
        for d in range(n):
            r = p.per_device[d].holds[key]
            top.add_patch(_cell(d, y, color))
            top.text(d + 0.5, y + 0.5, fmt_range(r).replace(" (", "\n("), ha="center", va="center", fontsize=7)
    top.set_xlim(0, n)
    top.set_ylim(len(rows), 0)
    top.set_yticks([y + 0.5 for y in range(len(rows))],
                   [f"{LABELS[k]} ({p.sizes[k]})" for k in rows], fontsize=8)
    top.set_xticks([d + 0.5 for d in range(n)], [f"dev {d}\nchip {x.chip} core {x.core}"
                                                for d, x in enumerate(p.per_device)], fontsize=7)
    top.xaxis.tick_top()
    top.tick_params(length=0)
    for side in top.spines.values():
        side.set_visible(False)

    for d, dev in enumerate(p.per_device):
        parts = dict(dev.weight_bytes_by_part, kv=dev.kv_bytes, gdn_state=dev.gdn_state_bytes)
        base = 0.0
        for key, _, color in BARS:
            value = parts.get(key, 0) / GiB
            bottom.bar(d + 0.5, value, bottom=base, width=0.7, color=color)
            base += value
        bottom.text(d + 0.5, base, f"{base:,.1f}", ha="center", va="bottom", fontsize=7)
    hbm = p.usable_hbm_bytes_per_device / GiB
    bottom.axhline(hbm, color=COLORS["capacity"], lw=1.5)
    bottom.text(n, hbm, f" usable HBM {hbm:,.2f} GiB", va="bottom", ha="right", fontsize=8)
    bottom.set_xlim(0, n)
    bottom.set_ylim(0, max(hbm, p.total_bytes_per_device / GiB) * 1.15)
    bottom.set_xticks([d + 0.5 for d in range(n)], [f"dev {d}" for d in range(n)], fontsize=7)
    bottom.set_ylabel("GiB per device")
    fig.legend(handles=[Patch(color=c, label=label) for _, label, c in BARS], loc="outside lower center",
               ncol=len(BARS), fontsize=8, frameon=False)
    fig.suptitle(_title(p), fontsize=10, color="black" if p.fits else COLORS["kv"])
    return fig


def _cell(x: float, y: float, color: str) -> Rectangle:
    return Rectangle((x + 0.03, y + 0.05), 0.94, 0.9, color=color)


def _title(p: Placement) -> str:
    head = f"{p.model}, {p.layout} on {p.devices} devices; {p.requests} requests x {p.context_len:,} tokens"
    if p.problem:
        return f"{head}\nREFUSED: {p.problem.split(';')[0]}"
    verdict = "fits" if p.fits else "does NOT fit"
    return f"{head}\n{p.total_bytes_per_device / GiB:,.1f} of {p.usable_hbm_bytes_per_device / GiB:,.2f} GiB usable " \
           f"per device: {verdict}"


def summary_html(p: Placement | str) -> str:
    """The summary text (a Placement's, or an error message) in a `<div class="qwen35-explorer-summary">`."""
    text = p.summary() if isinstance(p, Placement) else p
    return f'<div class="{SUMMARY_CLASS}" style="white-space: pre-wrap; font-family: monospace; font-size: 12px">' \
           f"{html.escape(text)}</div>"


def hardware_names() -> tuple[str, ...]:
    """The systems the explorers offer: every one of `hardware.names()` but `cpu` (this machine's RAM)."""
    return tuple(n for n in hw.names() if n != "cpu")


def step_collectives(config: Config, layout: str, devices: int = 8, routing: str | None = "replicate",
                     requests: int = 512, context_len: int = 8192, backend: str = "tpu") -> dict[str, dict]:
    """{step: {"tokens": per rank, "kinds": {kind: (ops run, bytes)}}} per device, for a decode and a prefill step.

    1. the plan: `custom_stage(layout, routing)` as it runs on `devices` devices, bound to their mesh once
       (`ServingPlan.on_devices`, `bind`; its refusal, or the cost model's "no closed form", is a ValueError);
    2. "decode": every request one token, ceil(requests / R) per rank; "prefill": the recipe's token budget for
       prompts of `context_len` (`costmodel.predict.token_budget`) per rank; each as `StepShape.of_compile`;
    3. `costmodel.traffic.collective_counts` of each (what the time model prices and the HLO test checks), the kinds
       that run only.
    """
    n = 1 if layout == "single" else devices
    plan = custom_stage(layout, routing).on_devices(n).bind(abstract_mesh(n), config, platform=backend)
    tokens = dict(decode=-(-requests // plan.dp), prefill=token_budget(context_len, plan.dp))
    out = {}
    for step in STEPS:
        decode, prefill = (tokens[step], 0) if step == "decode" else (0, tokens[step])
        shape = traffic.StepShape.of_compile(config, plan.dp, requests, decode, prefill)
        counts = traffic.collective_counts(plan, config, shape, backend)
        out[step] = dict(tokens=shape.tokens, kinds={k: v for k, v in counts.items() if v[0]})
    return out


def fmt_bytes(n: float) -> str:
    """Bytes as GiB / MiB / KiB / B, 2 decimals (the static explorer's JavaScript `fmtBytes` writes the same)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _ops(n: int) -> str:
    return f"{n:,} op" + ("s" if n != 1 else "")


def collectives_html(table: dict[str, dict] | str, routing: str | None = None) -> str:
    """`step_collectives`' table (or a message) as `<div class="qwen35-explorer-collectives">`: kinds x steps."""
    if isinstance(table, str):
        return f'<div class="{COLLECTIVES_CLASS}"><b>collectives per step</b>: {html.escape(table)}</div>'
    kinds = list(dict.fromkeys(k for t in table.values() for k in t["kinds"]))
    head = "".join(f"<th>{s} step ({t['tokens']:,.0f} tokens per rank)</th>" for s, t in table.items())
    rows = "".join(f"<tr><td>{k}</td>" + "".join(
        f"<td>{_ops(t['kinds'][k][0])}, {fmt_bytes(t['kinds'][k][1])}</td>" if k in t["kinds"] else "<td>-</td>"
        for t in table.values()) + "</tr>" for k in kinds) or '<tr><td colspan="3">none: one device</td></tr>'
    tot = "".join(f"<td>{fmt_bytes(sum(b for _, b in t['kinds'].values()))}</td>" for t in table.values())
    return (f'<div class="{COLLECTIVES_CLASS}" style="font-size: 12px"><b>collectives per device per step</b> '
            f"(the cost model's closed form, routing {routing or 'n/a: TP MoE'})<table><tr><th>kind</th>{head}"
            f"</tr>{rows}<tr><td>all kinds</td>{tot}</tr></table></div>")


def sharding_explorer(model: str = "qwen3.5-397b-a17b", layout: str = "dp8_ep8", devices: int = 8,
                      kv_dtype: str | None = None, requests: int = 512, *, context_len: int = 8192,
                      expert_dtype: str | None = "float8_e4m3fn", hardware: str = "tpu7x-8",
                      routing: str = "replicate", gdn_state_dtype: str = "float32"):
    """An ipywidgets box: controls, the summary and collectives (one HTML) and the placement figure (an Output).

    1. controls (descriptions are stable): "model", "layout", "devices", "hardware" (sets "devices" to its own
       count), "KV dtype", "expert dtype", "GDN state", "context" (tokens per request), "requests", "routing"
       (EP layouts: how tokens reach the experts);
    2. on any change: `placement(get_config(model, expert_dtype=..., gdn_state_dtype=...), layout, ...)` and
       `step_collectives(...)`, then the summary, the collectives table and the figure are replaced; a ValueError
       (e.g. a model the expert dtype cannot apply to) shows as the summary;
    3. the figure goes into the Output's `outputs` as PNG display data, so it updates with or without a kernel.
    """
    import ipywidgets as w

    style = {"description_width": "initial"}
    contexts = sorted({*CONTEXT_LENS, context_len})
    controls = dict(
        model=w.Dropdown(options=list(PRESETS), value=model, description="model", style=style),
        layout=w.Dropdown(options=list(LAYOUTS), value=layout, description="layout", style=style),
        devices=w.Dropdown(options=list(DEVICE_COUNTS), value=devices, description="devices", style=style),
        hardware=w.Dropdown(options=list(hardware_names()), value=hardware, description="hardware", style=style),
        kv_dtype=w.Dropdown(options=list(KV_DTYPES), value=kv_dtype or MODEL_DTYPE, description="KV dtype",
                            style=style),
        expert_dtype=w.Dropdown(options=list(EXPERT_DTYPE_OPTIONS), value=expert_dtype or MODEL_DTYPE,
                                description="expert dtype", style=style),
        gdn_state_dtype=w.Dropdown(options=list(GDN_DTYPES), value=gdn_state_dtype, description="GDN state",
                                   style=style),
        context_len=w.Dropdown(options=[(f"{n:,}", n) for n in contexts], value=context_len, description="context",
                               style=style),
        requests=w.BoundedIntText(value=requests, min=1, max=1 << 20, step=64, description="requests", style=style),
        routing=w.Dropdown(options=list(ROUTINGS), value=routing, description="routing", style=style),
    )
    summary = w.HTML(value="")
    output = w.Output()
    busy = []  # set while "hardware" moves "devices": one update, not two

    def update(_=None) -> None:
        if busy:
            return
        v = {k: None if c.value == MODEL_DTYPE else c.value for k, c in controls.items()}
        try:
            cfg = get_config(v["model"], expert_dtype=v["expert_dtype"], gdn_state_dtype=v["gdn_state_dtype"])
            p = placement(cfg, v["layout"], v["devices"], v["kv_dtype"], v["requests"], context_len=v["context_len"],
                          hardware=v["hardware"])
        except ValueError as e:
            summary.value = summary_html(f"error: {e}")
            output.outputs = ()
            return
        try:
            table = "none: the layout is refused (above)" if p.problem else step_collectives(
                cfg, v["layout"], p.devices, v["routing"], v["requests"], v["context_len"], hw.get(v["hardware"]).kind)
        except ValueError as e:
            table = str(e)
        routed = get_layout(v["layout"]).moe == "ep"
        summary.value = summary_html(p) + collectives_html(table, v["routing"] if routed else None)
        buf = io.BytesIO()
        placement_figure(p).savefig(buf, format="png", dpi=80)
        png = base64.b64encode(buf.getvalue()).decode("ascii")
        output.outputs = ({"output_type": "display_data", "metadata": {},
                           "data": {"image/png": png, "text/plain": f"<placement figure: {p.layout}>"}},)

    def on_hardware(change) -> None:
        n = hw.get(change["new"]).devices
        if n in DEVICE_COUNTS and n != controls["devices"].value:
            busy.append(1)
            controls["devices"].value = n
            busy.clear()

    controls["hardware"].observe(on_hardware, names="value")
    for c in controls.values():
        c.observe(update, names="value")
    update()
    rows = list(controls.values())
    return w.VBox([w.HBox(rows[:4]), w.HBox(rows[4:7]), w.HBox(rows[7:]), summary, output])

