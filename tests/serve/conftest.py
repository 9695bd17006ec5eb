"""The server the serve tests share: one per module (`serve_support.running`: the tiny random model, a byte-level
tokenizer), started at the module's first use. A module that needs other limits defines its own `server`."""

import pytest


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests import serve_support  # not at import: the modules without fastapi skip before it is needed

    with serve_support.running(tmp_path_factory.mktemp("tok")) as s:
        yield s
