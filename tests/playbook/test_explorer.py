"""playbook.explorer: the static page's precomputed grid is the library's placement, collectives and predictions,
and the page embeds it."""

from __future__ import annotations

import json
import pathlib
import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from playbook import explorer  # noqa: E402
from qwen35_lib.config import get_config  # noqa: E402
from qwen35_lib.costmodel import predict, traffic  # noqa: E402
from qwen35_lib.costmodel.predict import token_budget  # noqa: E402
from qwen35_lib.placement import placement  # noqa: E402
from qwen35_lib.plan import abstract_mesh, custom_stage  # noqa: E402
from qwen35_lib.viz.sharding_explorer import step_collectives  # noqa: E402

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
    # the 2 x 2: attribution's corners, each the prediction of its stage
    from qwen35_lib.costmodel.attribution import CORNERS

    corners = lad["corners"]["1k/1k|16"]
    assert set(corners) == set(CORNERS.values()) == {st for _, _, st in lad["corner_axes"]}
    for st in ("google_baseline", "kernels"):
        assert corners[st] == predict(MODEL, "tpu7x-8", st, 1024, 1024, 16, roofline=False)["total_tokens_per_s"]


def test_the_explorer_offers_the_whole_context_first():
    """The chapters' serving shape, a request's whole context (9,216 tokens: 8k in + 1k out), is on the grid and the
    page's default."""
    assert explorer.WHOLE_CONTEXT == 8192 + 1024 and explorer.WHOLE_CONTEXT in explorer.SHARDING["contexts"]
    body = explorer.page_body(dict(model=MODEL, axes=dict(contexts=[8192, explorer.WHOLE_CONTEXT]), memory={},
                                   collectives={}),
                              dict(points={}), 0.0)
    assert f", {explorer.WHOLE_CONTEXT}, renderSharding)" in body and "__CONTEXT__" not in body
    assert 'id="two-by-two-table"' in body and "renderCorners()" in body


def test_page_embeds_the_grid(tmp_path: pathlib.Path):
    path = explorer.write_page(tmp_path, dict(SMALL, contexts=(8192,)),
                               dict(workloads=((1024, 1024),), concurrencies=(16,)))
    text = path.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="explorer-data">(.*?)</script>', text,
                                re.S).group(1))
    assert set(data) == {"sharding", "ladder"} and 'href="index.html"' in text and "qwen35-explorer-summary" in text
