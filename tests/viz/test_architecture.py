"""The figures are pure functions that return a Figure and draw headless."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from qwen35_lib import budget, viz  # noqa: E402
from qwen35_lib.config import get_config  # noqa: E402


def _draws(fig: Figure) -> None:
    assert isinstance(fig, Figure) and fig.axes
    fig.savefig(io.BytesIO(), format="png")


def test_param_breakdown_and_layer_pattern():
    for name in ("qwen3.5-397b-a17b", "qwen3.5-tiny"):
        cfg = get_config(name)
        _draws(viz.plot_param_breakdown(cfg))
        _draws(viz.plot_layer_pattern(cfg))


def test_hbm_budget():
    cfg = get_config("qwen3.5-397b-a17b", gdn_state_dtype="bfloat16")
    budgets = [budget.hbm_budget(c, "tpu7x-8", 512, n)
               for c in (cfg, cfg.replace(expert_dtype="float8_e4m3fn")) for n in (8192, 1024)]
    fig = viz.plot_hbm_budget(budgets)
    _draws(fig)
    assert len(fig.axes[0].get_xticklabels()) == 4
