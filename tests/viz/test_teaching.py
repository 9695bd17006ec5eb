"""The teaching figures (the mesh, the collective steps, the ladder's savings) draw headless from plain data."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from qwen35_lib.viz import teaching  # noqa: E402


def _draws(fig: Figure) -> Figure:
    assert isinstance(fig, Figure) and fig.axes
    fig.savefig(io.BytesIO(), format="png")
    return fig


def test_the_mesh_names_every_device_and_both_axes():
    fig = _draws(teaching.plot_mesh([[0, 1], [2, 3], [4, 5], [6, 7]]))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert [f"dev {d}" in " ".join(texts) for d in range(8)] == [True] * 8
    assert sum(t.startswith("chip ") for t in texts) == 4
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("'chip'" in s for s in labels) and any("'core'" in s for s in labels)


def test_collective_steps_count_the_copies_each_strategy_moves():
    routes = [[[1, 2]], [[0, 0]], [[3, 2]], [[1, 3]]]  # 4 devices, a token each, its experts' devices
    fig = _draws(teaching.plot_collective_steps(routes))
    words = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    # replication: every token to the 3 other devices; dispatch: only to the other devices among its experts
    assert "replicate\n(12 token" in words and "all_to_all\n(5 token" in words  # 2 + 1 + 1 + 1
    _draws(teaching.plot_collective_steps(n_devices=8, tokens_per_device=2))


def test_ladder_savings_stack_each_steps_components():
    comps = ("attention", "gdn", "cache", "moe", "collectives", "other")
    gains = {st: {wl: dict(gain=g, saved_ms_per_1k_tokens={c: s * (i + 1) for i, c in enumerate(comps)})
                  for wl in ("8k/1k", "1k/8k")} for st, g, s in (("dp_ep", 2.0, 10.0), ("kernels", 8.0, -1.0))}
    fig = _draws(teaching.plot_ladder_savings(gains))
    assert len(fig.axes) == 2 and "x8.00" in [t.get_text() for t in fig.axes[0].texts]
    heights = sorted(p.get_height() for p in fig.axes[0].patches)
    assert heights[0] == pytest.approx(-6.0) and heights[-1] == pytest.approx(60.0)
