"""The site's explorers without a kernel: the library's numbers precomputed on a grid at build time, embedded as JSON
in `explorer.html`, looked up by plain JavaScript controls (the browser computes nothing but bar widths).

    write_page(out)                               # <out>/explorer.html, a few seconds
    sharding_grid(hardware=("tpu7x-8",), ...)     # the data, JSON-able; smaller grids for tests
    ladder_grid(workloads=((1024, 1024),), ...)

1. memory: `placement.placement` of the 397B model for every hardware x layout x context length x KV dtype x
   expert dtype x GDN state dtype x requests; one placement per device count, each hardware's HBM and fit set on
   that record as `placement(..., hardware=...)` sets them (tests/playbook/test_explorer.py checks they are equal);
2. collectives per device per step: `viz.sharding_explorer.step_collectives` (the cost model's closed form,
   `costmodel.traffic.collective_counts`) for every device count x layout x routing x requests x context length;
3. the ladder: `costmodel.ladder` (nominal assumptions, no roofline run) for every workload x concurrency.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import itertools
import json
import pathlib
import time

from qwen35_lib import hardware as hw
from qwen35_lib.config import get_config
from qwen35_lib.placement import Placement, placement
from qwen35_lib.plan import ROUTINGS
from qwen35_lib.viz.sharding_explorer import CONTEXT_LENS, GDN_DTYPES, hardware_names, step_collectives

HERE = pathlib.Path(__file__).resolve().parent
FILE = "explorer.html"
TITLE = "Explorers: placement, collectives and the ladder, without a kernel"
MODEL = "qwen3.5-397b-a17b"
WORKLOADS = ((8192, 1024), (1024, 8192))  # the playbook's two workloads (input, output tokens)
WHOLE_CONTEXT = max(i + o for i, o in WORKLOADS)  # a request's whole context in either: the chapters' serving shape
SHARDING = dict(hardware=tuple(n for n in hardware_names() if hw.get(n).devices > 1),
                layouts=("tp", "tp_kvrep", "dp_tp2_ep", "dp_ep"),
                contexts=tuple(sorted({*CONTEXT_LENS, WHOLE_CONTEXT})),
                kv_dtypes=("bfloat16", "float8_e4m3fn"), expert_dtypes=("bfloat16", "float8_e4m3fn"),
                gdn_state_dtypes=GDN_DTYPES, requests=(128, 512), routings=ROUTINGS)
LADDER = dict(hardware="tpu7x-8", workloads=WORKLOADS, concurrencies=(64, 128, 256, 512))
CORNERS = {("TP (tp8_kvrep)", "XLA"): "baseline", ("TP (tp8_kvrep)", "Pallas"): "google_baseline",
           ("DP + EP (dp8_ep8)", "XLA"): "hier_rs", ("DP + EP (dp8_ep8)", "Pallas"): "kernels"}  # the 2 x 2
PARTS = ("attention", "GDN", "routed experts", "other")  # DevicePlacement.weight_bytes_by_part keys


def key(*parts) -> str:
    """A grid point's key, as the page's JavaScript builds it: the choices joined by '|'."""
    return "|".join(str(p) for p in parts)


def on_hardware(p: Placement, name: str) -> Placement:
    """`p` as `placement(..., hardware=name)` returns it: the same bytes, that hardware's HBM and so its fit."""
    h = hw.get(name)
    return dataclasses.replace(p, hardware=name, hbm_bytes_per_device=h.hbm_bytes_per_device,
                               usable_hbm_bytes_per_device=h.usable_hbm_bytes_per_device)


MEMORY_FIELDS = (*PARTS, "weights", "kv", "gdn_state", "total", "fits", "problem", "replicated")


def memory_point(p: Placement, hardware: list[str], text) -> list:
    """What the page shows of one placement, as MEMORY_FIELDS (bytes per device: the largest device's, as
    `Placement.summary` reads them); "fits" on each of `hardware` (same device count); strings as `text(s)`,
    their index in the page's shared list."""
    parts = p.per_device[0].weight_bytes_by_part
    return [*(parts.get(k, 0) for k in PARTS), p.weight_bytes_per_device, p.kv_bytes_per_device,
            p.gdn_state_bytes_per_device, p.total_bytes_per_device, [int(on_hardware(p, n).fits) for n in hardware],
            -1 if p.problem is None else text(p.problem), [text(r) for r in p.replicated]]


def sharding_grid(model: str = MODEL, **grid) -> dict:
    """The sharding explorer's data; `grid` overrides SHARDING's axes.

    memory {devices|layout|context|kv|expert|gdn|requests: memory_point}, "fits" in the order of
    devices[devices]; collectives {devices|layout|routing|requests|context: step_collectives' table, or
    {"error": text index}}; hardware {name: devices, usable bytes per device, mesh}; texts: the strings.
    """
    from qwen35_lib.plan import get_layout

    g = {**SHARDING, **grid}
    memory, collectives, systems, texts = {}, {}, {}, {}
    text = lambda t: texts.setdefault(t, len(texts))  # noqa: E731
    by_devices: dict[int, list[str]] = {}
    for name in g["hardware"]:
        by_devices.setdefault(hw.get(name).devices, []).append(name)
    for devices, names in by_devices.items():
        for expert, gdn in itertools.product(g["expert_dtypes"], g["gdn_state_dtypes"]):
            cfg = get_config(model, expert_dtype=None if expert == "bfloat16" else expert, gdn_state_dtype=gdn)
            for layout, ctx, kv, req in itertools.product(g["layouts"], g["contexts"], g["kv_dtypes"], g["requests"]):
                p = placement(cfg, layout, devices, kv, req, context_len=ctx, hardware=names[0])
                memory[key(devices, layout, ctx, kv, expert, gdn, req)] = memory_point(p, names, text)
        mesh = " x ".join(f"{n} {a}" for a, n in p.mesh_shape.items())
        systems |= {n: dict(devices=devices, usable=on_hardware(p, n).usable_hbm_bytes_per_device, mesh=mesh)
                    for n in names}
        cfg = get_config(model)
        for layout, routing, req, ctx in itertools.product(g["layouts"], g["routings"], g["requests"], g["contexts"]):
            try:
                table = step_collectives(cfg, layout, devices, routing, req, ctx, hw.get(names[0]).kind)
            except ValueError as e:
                table = {"error": text(str(e))}
            collectives[key(devices, layout, routing, req, ctx)] = table
    return dict(model=model, axes={k: list(v) for k, v in g.items()}, hardware=systems,
                devices={str(d): names for d, names in by_devices.items()},
                layouts={n: dict(summary=get_layout(n).summary, moe=get_layout(n).moe) for n in g["layouts"]},
                memory_fields=list(MEMORY_FIELDS), memory=memory, collectives=collectives, texts=list(texts))


def ladder_grid(model: str = MODEL, **grid) -> dict:
    """points {workload|concurrency: [one row per stage]} of `costmodel.ladder`, and corners {workload|concurrency:
    {stage: total tokens/s}} of the 2 x 2 (layout x kernels, CORNERS: `costmodel.attribution`'s corners, the
    `google_baseline` plan predicted beside the ladder); `grid` overrides LADDER's."""
    from qwen35_lib.costmodel import ladder
    from qwen35_lib.plan import LADDER as STAGES

    g = {**LADDER, **grid}
    keep = ("stage", "fits", "total_tokens_per_s", "output_tokens_per_s", "mean_step_s", "median_tpot_s", "gain",
            "vs_baseline")
    points, workloads, corners = {}, {}, {}
    for (isl, osl), conc in itertools.product(g["workloads"], g["concurrencies"]):
        rows = ladder(model, g["hardware"], ((isl, osl),), conc, google_baseline=True, roofline=False)
        workloads[rows[0]["workload"]] = [isl, osl]  # "8k/1k": ladder's own name
        points[key(rows[0]["workload"], conc)] = [{k: r.get(k) for k in keep} for r in rows]
        by_stage = {r["stage"]: r for r in rows}
        corners[key(rows[0]["workload"], conc)] = {
            st: (by_stage[st]["total_tokens_per_s"] if by_stage[st]["fits"] else None) if st in by_stage
            else by_stage["kernels"].get("google_baseline_total_tokens_per_s") for st in CORNERS.values()}
    return dict(model=model, hardware=g["hardware"], stages=list(STAGES), concurrencies=list(g["concurrencies"]),
                workloads=workloads, points=points, corners=corners,
                corner_axes=[[layout, kernels, st] for (layout, kernels), st in CORNERS.items()])


def page_body(sharding: dict, ladder: dict, seconds: float) -> str:
    """The page's HTML: the template with the data embedded (`</` escaped so no string ends the script)."""
    data = json.dumps(dict(sharding=sharding, ladder=ladder), separators=(",", ":")).replace("</", "<\\/")
    n = len(sharding["memory"]) + len(sharding["collectives"]) + len(ladder["points"])
    note = (f"{n:,} grid points computed by <code>qwen35_lib</code> when this site was built ({seconds:.1f} s): "
            f"<code>placement.placement</code>, <code>costmodel.traffic.collective_counts</code>, "
            f"<code>costmodel.ladder</code>. Model: <code>{html.escape(sharding['model'])}</code>.")
    page = (HERE / "templates" / "explorer.html").read_text().replace("__NOTE__", note)
    default = WHOLE_CONTEXT if WHOLE_CONTEXT in sharding["axes"]["contexts"] else sharding["axes"]["contexts"][0]
    return page.replace("__CONTEXT__", str(default)).replace("__DATA__", data)


def write_page(out: pathlib.Path, sharding: dict | None = None, ladder: dict | None = None) -> pathlib.Path:
    """Compute the grids (`sharding`, `ladder`: axis overrides) and write `<out>/explorer.html`; returns its path."""
    from playbook.page import Page, nav, page_html

    body = _body(json.dumps(sharding or {}), json.dumps(ladder or {}))
    path = pathlib.Path(out) / FILE
    path.write_text(page_html(TITLE, body, nav([Page(FILE, TITLE)], 0)), encoding="utf-8")
    return path


@functools.lru_cache(maxsize=4)  # a process that builds two sites (the site tests) computes the grids once
def _body(sharding: str, ladder: str) -> str:
    start = time.perf_counter()
    s, lad = sharding_grid(**_axes(sharding)), ladder_grid(**_axes(ladder))
    return page_body(s, lad, time.perf_counter() - start)


def _axes(text: str) -> dict:
    """JSON overrides back to tuples (workloads: tuples of (isl, osl))."""
    return {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
            for k, v in json.loads(text).items()}
