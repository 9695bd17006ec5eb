"""viz.costmodel: the cost model's figures draw headless; the explorer's assumption sliders and ladder are the
library's predictions."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from qwen35_lib import costmodel  # noqa: E402
from qwen35_lib.costmodel import predict  # noqa: E402
from qwen35_lib.plan import LADDER  # noqa: E402
from qwen35_lib.viz import costmodel as viz_cm  # noqa: E402
from tests.widgets import by_label  # noqa: E402


def test_figures_headless():
    viz = viz_cm
    rows = costmodel.ladder(workloads=((1024, 256), (256, 1024)), concurrency=16, stages=("baseline", "kernels"))
    for fig in (viz.plot_ladder(rows, {"1k/256": 4.7}), viz.plot_breakdown(rows), viz.plot_roofline(rows)):
        assert isinstance(fig, Figure)
    cpu_rows = [dict(case="a", measured_s=0.1, predicted_s=0.12), dict(case="b", measured_s=0.2, predicted_s=0.15)]
    assert isinstance(viz.plot_cpu_validation(cpu_rows), Figure)
    assert isinstance(viz.plot_ratios([dict(x="a", r=1.2)], ["r"], "x", "t"), Figure)
    assert isinstance(viz.plot_sensitivity({"ICI": [(0.5, 5.0, 3.0), (1.0, 6.0, 3.5)]}), Figure)
    text, fig = viz.explore("qwen3.5-397b-a17b", "tpu7x-8", "kernels", 16, 1024, 256)
    assert "total tok/s" in text and isinstance(fig, Figure)
    text, fig = viz.explore("qwen3.5-397b-a17b", "v5e-8", "kernels", 16, 1024, 256)
    assert "does not fit" in text and fig is None


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


def test_layouts_view_draws_each_layouts_mechanisms_headless():
    """notebook 02's layouts view: a stacked bar a layout, its text naming the layout served (the shortest bar)."""
    text, fig = viz_cm.layouts_view(concurrency=4)
    assert "served: tp8_" in text and len(fig.axes) == 1
    assert len(fig.axes[0].patches) == 4 * 6  # 4 layouts x (5 mechanisms + other)


def test_layouts_explorer_has_a_concurrency_slider():
    box = viz_cm.layouts_explorer()
    sliders = [c for row in box.children[:2] for c in row.children if hasattr(c, "options")]
    assert any(list(s.options)[:3] == [1, 2, 4] for s in sliders)
