"""The `ckpts` fixture: models and checkpoint folders built once for the whole package, on first use."""

import pytest

from tests.checkpoint.support import Checkpoints


@pytest.fixture(scope="package")
def ckpts(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("ckpts"))
