"""The GDN side of `bench kernels` at qwen3.5-tiny size: its inputs' ranges, the cases' shapes by hand, the
Pallas kernels (interpreted here, labelled so) agreeing with the XLA reference, and an unknown case refused."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import get_config
from qwen35_lib.bench import kernels_gdn
from qwen35_lib.kernels.gdn import native as gdn_native
from qwen35_lib.kernels.native import build as native


def test_inputs_have_the_models_shapes_and_valid_gates():
    cfg = get_config("qwen3.5-tiny")
    q, k, v, g, beta = kernels_gdn.gdn_inputs(cfg, (3, 5), jnp.bfloat16, 0)
    assert q.shape == k.shape == (3, 5, 2, 16) and v.shape == (3, 5, 4, 24) and g.shape == beta.shape == (3, 5, 4)
    assert q.dtype == jnp.bfloat16 and g.dtype == beta.dtype == jnp.float32
    assert (np.asarray(g) <= 0).all() and ((np.asarray(beta) > 0) & (np.asarray(beta) < 1)).all()


def test_an_unknown_case_is_refused_with_the_cases():
    with pytest.raises(ValueError, match="unknown gdn bench case 'chunked'; cases are prefill, decode, mixed"):
        kernels_gdn.gdn_case(get_config("qwen3.5-tiny"), "chunked", 96, 2, jnp.float32, 0)


def test_rows_of_every_case_agree_with_the_xla_reference():
    rows = kernels_gdn.gdn_rows("qwen3.5-tiny", prefill_tokens=96, decode_batch=2, dtype="float32", repeats=1,
                                settle=0)
    impls = ("xla", "pallas", "native") if native.load(gdn_native.LIBRARY) is not None else ("xla", "pallas")
    assert [(r["case"], r["implementation"]) for r in rows] == [
        (c, i) for c in ("prefill", "decode", "mixed") for i in impls]
    shapes = {r["case"]: r["shape"] for r in rows}
    # mixed: 2 decodes, prompts of 96 / 2 + 5 = 53 (from position 64) and 96 / 2 - 40 = 8 tokens, each rounded up
    # to a 64-token chunk: T = 2 + 64 + 64
    assert shapes == {"prefill": "B=1 T=96", "decode": "B=2 T=1",
                      "mixed": "2 decodes + prefills of 53 (mid-sequence) and 8 tokens, T=130"}
    for r in rows:
        assert r["heads"] == [2, 4, 16, 24] and r["dtype"] == "float32" and r["backend"] == "cpu"
        assert r["max_abs_diff_vs_xla"] < 1e-4  # float32: the same math in another order
        if r["implementation"] == "xla":
            assert r["speedup_vs_xla"] == 1.0 and r["max_abs_diff_vs_xla"] == 0.0 and r["mode"] == "xla"
        elif r["implementation"] == "native":
            assert r["mode"] == "native (C++ on the CPU)"
        else:
            assert r["mode"] == "pallas interpret (numerics only, not a TPU time)"
        assert r["min_ms"] <= r["median_ms"]
