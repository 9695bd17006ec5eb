"""The explorers' numbers are the library's: the static page's precomputed grid, the sharding explorer's collectives
and the cost-model explorer's assumption sliders and ladder (headless)."""

from __future__ import annotations

import json
import pathlib
import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from widgets import by_label  # noqa: E402

from playbook import explorer  # noqa: E402
from qwen35_lib.config import get_config  # noqa: E402
from qwen35_lib.costmodel import predict, traffic  # noqa: E402
from qwen35_lib.costmodel.predict import token_budget  # noqa: E402
from qwen35_lib.placement import placement  # noqa: E402
from qwen35_lib.plan import LADDER, abstract_mesh, custom_stage  # noqa: E402
from qwen35_lib.viz import costmodel as viz_cm  # noqa: E402
from qwen35_lib.viz.sharding_explorer import sharding_explorer, step_collectives  # noqa: E402

SMALL = dict(hardware=("tpu7x-8", "v6e-8", "v5p-8"), layouts=("tp_kvrep", "dp_ep"), contexts=(8192, 32768),
             requests=(512,))
MODEL = explorer.MODEL


@pytest.fixture(scope="module")
def grid() -> dict:
    return explorer.sharding_grid(**SMALL)


def _point(grid: dict, hardware: str, layout: str, ctx: int, kv: str, expert: str, gdn: str, req: int) -> dict:
    devices = grid["hardware"][hardware]["devices"]
    values = grid["memory"][explorer.key(devices, layout, ctx, kv, expert, gdn, req)]
    m = dict(zip(grid["memory_fields"], values))
    m["fits"] = bool(m["fits"][grid["devices"][str(devices)].index(hardware)])
    return m


@pytest.mark.parametrize("point", [("v6e-8", "dp_ep", 32768, "float8_e4m3fn", "float8_e4m3fn", "bfloat16", 512),
                                   ("v5p-8", "tp_kvrep", 8192, "bfloat16", "bfloat16", "float32", 512),
                                   ("tpu7x-8", "dp_ep", 8192, "bfloat16", "float8_e4m3fn", "float32", 512)])
def test_memory_grid_is_placement(grid: dict, point: tuple):
    hardware, layout, ctx, kv, expert, gdn, req = point
    cfg = get_config(MODEL, expert_dtype=None if expert == "bfloat16" else expert, gdn_state_dtype=gdn)
    devices = grid["hardware"][hardware]["devices"]
    p = placement(cfg, layout, devices, kv, req, context_len=ctx, hardware=hardware)
    m = _point(grid, hardware, layout, ctx, kv, expert, gdn, req)
    assert (m["weights"], m["kv"], m["gdn_state"], m["total"], m["fits"]) == (
        p.weight_bytes_per_device, p.kv_bytes_per_device, p.gdn_state_bytes_per_device, p.total_bytes_per_device,
        p.fits)
    assert grid["hardware"][hardware]["usable"] == p.usable_hbm_bytes_per_device
    assert sum(m[k] for k in explorer.PARTS) == m["weights"]
    # the shared record, moved to another system of the same device count, is that system's placement
    other = placement(cfg, layout, devices, kv, req, context_len=ctx, hardware="tpu7x-8")
    assert devices != 8 or explorer.on_hardware(other, hardware) == p


def test_collectives_grid_is_the_cost_models(grid: dict):
    cfg = get_config(MODEL)
    table = grid["collectives"][explorer.key(8, "dp_ep", "all_to_all", 512, 32768)]
    plan = custom_stage("dp_ep", "all_to_all").bind(abstract_mesh(8), cfg)
    want = traffic.collective_counts(plan, cfg, traffic.StepShape.of_compile(cfg, plan.dp, 512, 64, 0))
    assert table["decode"]["kinds"] == {k: v for k, v in want.items() if v[0]}
    assert table["prefill"]["tokens"] == traffic.StepShape.of_compile(
        cfg, 8, 512, 0, token_budget(32768, 8)).tokens
    tp = grid["collectives"][explorer.key(8, "tp_kvrep", "replicate", 512, 8192)]  # routing: not read by TP
    assert tp == step_collectives(cfg, "tp_kvrep", 8, None, 512, 8192) and "all-reduce" in tp["decode"]["kinds"]


def test_ladder_grid_is_predict():
    lad = explorer.ladder_grid(workloads=((1024, 1024),), concurrencies=(16,))
    rows = lad["points"]["1k/1k|16"]
    assert [r["stage"] for r in rows] == lad["stages"]
    r = predict(MODEL, "tpu7x-8", "replicate", 1024, 1024, 16, roofline=False)
    assert rows[lad["stages"].index("replicate")]["total_tokens_per_s"] == r["total_tokens_per_s"]


def test_page_embeds_the_grid(tmp_path: pathlib.Path):
    path = explorer.write_page(tmp_path, dict(SMALL, contexts=(8192,)),
                               dict(workloads=((1024, 1024),), concurrencies=(16,)))
    text = path.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="explorer-data">(.*?)</script>', text,
                                re.S).group(1))
    assert set(data) == {"sharding", "ladder"} and 'href="index.html"' in text and "qwen35-explorer-summary" in text


def test_sharding_explorer_controls_and_collectives():
    box = sharding_explorer()
    widgets = by_label(box)
    assert {"hardware", "context", "expert dtype", "GDN state", "routing"} <= set(widgets)
    html = widgets["HTML"].value
    assert "qwen35-explorer-collectives" in html and "reduce-scatter" in html
    widgets["routing"].value = "all_to_all"
    assert "all-to-all" in widgets["HTML"].value and "reduce-scatter" not in widgets["HTML"].value
    widgets["hardware"].value = "v5p-8"
    assert widgets["devices"].value == 4 and "REFUSED" in widgets["HTML"].value  # dp8_ep8 is the 8-device form


def test_costmodel_assumptions_and_ladder():
    ranges = viz_cm.range_assumptions()
    assert ranges and all(r["low"] <= r["value"] <= r["high"] for r in ranges.values())
    base, _ = viz_cm.explore("qwen3.5-397b-a17b", "tpu7x-8", "kernels", 64, 1024, 1024)
    changed, _ = viz_cm.explore("qwen3.5-397b-a17b", "tpu7x-8", "kernels", 64, 1024, 1024,
                                assumptions={"host_step_overhead_s": ranges["host_step_overhead_s"]["high"]})
    assert changed != base
    rows, fig = viz_cm.explore_ladder(concurrency=16, isl=1024, osl=1024)
    assert [r["stage"] for r in rows] == list(LADDER) and fig.axes and "over baseline" in viz_cm.ladder_text(rows)
    want = predict("qwen3.5-397b-a17b", "tpu7x-8", "kernels", 1024, 1024, 16, roofline=False)
    assert rows[-1]["total_tokens_per_s"] == want["total_tokens_per_s"]


def test_costmodel_explorer_has_a_slider_per_assumption():
    box = viz_cm.explorer()
    widgets = by_label(box)
    for name, r in viz_cm.range_assumptions().items():
        assert (widgets[name].min, widgets[name].value, widgets[name].max) == (r["low"], r["value"], r["high"])
    widgets["collective_overlap"].value = 0.5  # re-predicts without error
