"""viz.sharding_explorer: the placement figure draws headless; the explorer's controls move its collectives and
its summary."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

from qwen35_lib.config import get_config  # noqa: E402
from qwen35_lib.placement import placement  # noqa: E402
from qwen35_lib.viz.sharding_explorer import SUMMARY_CLASS, placement_figure, sharding_explorer  # noqa: E402
from tests.widgets import by_label  # noqa: E402


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


def test_figure_and_explorer_headless():
    fig = placement_figure(placement(get_config("qwen3.5-397b-a17b", expert_dtype="float8_e4m3fn"), "tp8"))
    fig.savefig(io.BytesIO(), format="png")
    box = sharding_explorer()
    widgets = by_label(box)
    assert {"model", "layout", "devices", "KV dtype", "requests", "HTML", "Output"} <= set(widgets)
    summary = widgets["HTML"]
    before = summary.value
    assert SUMMARY_CLASS in before and "fits" in before and "REFUSED" not in before
    widgets["layout"].value = "tp8"
    assert summary.value != before and "REFUSED" in summary.value and "tp8_kvrep" in summary.value
    assert "image/png" in widgets["Output"].outputs[0]["data"]
    widgets["requests"].value = 8
    assert "8 requests" in summary.value
