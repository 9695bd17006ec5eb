"""Run by tests/integration/test_widgets_runtime.py in a fresh process: every explorer of `qwen35_lib.viz` built and
moved on a runtime that brings ipywidgets (and matplotlib, IPython) but nothing else of the `notebook` extra, as
Colab's does, where the notebooks' install line adds only the `reference` extra. argv[1], if given and not empty: a
folder put first on sys.path (another ipywidgets, e.g. Colab's 7.7.1 installed there with `pip install --target DIR
--no-deps ipywidgets==7.7.1 ipython_genutils`). Prints `ipywidgets VERSION` and one `NAME ok` line per explorer; an
argument a widget does not know (traitlets' warning) or a missing import fails it."""

import sys
import warnings

if len(sys.argv) > 1 and sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
for other in ("jupytext", "jupyterlab", "nbclient", "nbconvert", "nbformat", "rich"):  # the rest of the extra
    sys.modules[other] = None  # import fails
warnings.filterwarnings("error", message=".*unrecognized arguments")  # traitlets: a keyword the widget lacks

import ipywidgets  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
from qwen35_lib.viz import costmodel as viz_cm  # noqa: E402
from qwen35_lib.viz.sharding_explorer import sharding_explorer  # noqa: E402
from tests.widgets import by_label  # noqa: E402

print("ipywidgets", ipywidgets.__version__)
for make, name, value in ((viz_cm.explorer, "concurrency", 64), (viz_cm.layouts_explorer, "concurrency", 8),
                          (sharding_explorer, "routing", "all_to_all")):
    box = make()
    by_label(box)[name].value = value  # re-renders through the widget's observer
    print(make.__name__, "ok")
