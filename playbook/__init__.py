"""The playbook: notebooks executed into a small static site (`python -m playbook.build`).

`GITHUB_REPO` is the one place the repository's GitHub name lives: each notebook's Colab badge and its
install-if-missing cell must use it (tests/integration/test_notebooks.py checks).
"""

from qwen35_lib.notebook import RESULTS_ENV  # noqa: F401 (where notebooks write results: the builder sets it)

GITHUB_REPO = "qwen35-playbook/qwen35-playbook"
COLAB_URL = "https://colab.research.google.com/github/{repo}/blob/main/notebooks/{name}.ipynb"
