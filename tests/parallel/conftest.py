"""The 8 simulated devices as one ('chip', 'core') mesh, for the modules of this folder."""

import pytest

from qwen35_lib.plan import make_mesh


@pytest.fixture(scope="module")
def mesh():
    return make_mesh()
