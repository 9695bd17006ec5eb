"""The explorers on a runtime that brings only ipywidgets of the `notebook` extra (Colab's: the notebooks' install line
adds the `reference` extra, and Colab's ipywidgets is 7.x): tests/integration/widgets_runtime.py builds and moves
each in a fresh process with the extra's other packages unimportable and an unknown widget argument an error. Set
$QWEN35_IPYWIDGETS_PATH to a folder holding another ipywidgets to run it there too (checked by hand with 7.7.1: `pip
install --target DIR --no-deps ipywidgets==7.7.1 ipython_genutils`)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from qwen35_lib.viz import costmodel as viz_cm

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = pathlib.Path(__file__).with_name("widgets_runtime.py")


@pytest.mark.parametrize("where", ["installed", "QWEN35_IPYWIDGETS_PATH"])
def test_every_explorer_builds_and_moves_with_only_ipywidgets(where: str):
    path = os.environ.get(where, "") if where != "installed" else ""
    if where != "installed" and not path:
        pytest.skip("set $QWEN35_IPYWIDGETS_PATH to a folder with another ipywidgets (e.g. 7.7.1)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(SCRIPT), path], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    said = run.stdout.splitlines()
    assert [line for line in said if line.endswith(" ok")] == ["explorer ok", "layouts_explorer ok",
                                                               "sharding_explorer ok"], run.stdout[-2000:]


def test_the_hover_text_takes_the_keyword_of_the_ipywidgets_installed():
    class Seven:  # ipywidgets 7: the hover text is `description_tooltip`
        @classmethod
        def class_traits(cls):
            return {"description_tooltip": object()}

    class Eight:
        @classmethod
        def class_traits(cls):
            return {"tooltip": object(), "description_tooltip": object()}

    assert viz_cm.tooltip(Seven, "why") == {"description_tooltip": "why"}
    assert viz_cm.tooltip(Eight, "why") == {"tooltip": "why"}
