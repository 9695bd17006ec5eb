"""Figures as pure functions: data in, a `matplotlib.figure.Figure` out (no pyplot state, so they run headless).

In a notebook, a returned Figure shows as an image under the inline backend (`%matplotlib inline`).
"""

from qwen35_lib.viz.architecture import plot_hbm_budget, plot_layer_pattern, plot_param_breakdown

__all__ = ["plot_hbm_budget", "plot_layer_pattern", "plot_param_breakdown"]
