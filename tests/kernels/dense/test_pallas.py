"""kernels.dense.pallas: every projection form the model has, read in place from a [G, P, ...] stack, against the
XLA twin (interpret mode here; the TPU7x compile of the whole step is tests/integration/test_tpu_in_place.py).

Shapes are the model's forms at small widths: an input projection [K, A, N] (heads of a GDN or attention
projection), [K, N] (w_b, w_a; A = 1), [K, 2, F] (the shared expert's gate_up), an output projection [A, K, N]
(contract 2) and [F, D] (the shared expert's down, contract 1); rows past one row tile (`ROW_TILE`) and a weight
wide enough to be cut into output tiles (`BLOCK_BYTES`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib.kernels import get
from qwen35_lib.kernels.dense import pallas as dense_pallas
from qwen35_lib.kernels.stacked import LayerOf, layer_index

FORMS = [  # (x shape, stack shape [G, P, ...], contract)
    ((2, 5, 256), (2, 3, 256, 4, 128), 1),  # heads: [B, T, K] @ [K, A, N]
    ((7, 256), (2, 3, 256, 64), 1),  # [K, N], N < 128
    ((7, 256), (2, 3, 256, 2, 384), 1),  # shared gate_up [K, 2, F]
    ((3, 4, 128), (2, 3, 4, 128, 256), 2),  # output projection [A, K, N]
    ((9, 384), (2, 3, 384, 256), 1),  # shared down [F, D]
]


@pytest.mark.parametrize("xs,ws,contract", FORMS, ids=str)
def test_each_projection_form_matches_the_twin(xs, ws, contract):
    x = jax.random.normal(jax.random.key(0), xs, jnp.float32)
    w = LayerOf(jax.random.normal(jax.random.key(1), ws, jnp.float32), layer_index(1, 2))
    y = dense_pallas.stacked_linear(x, w, contract, interpret=True)
    ref = get("dense", "xla")(x, w, contract)
    assert y.shape == ref.shape == (*xs[:len(xs) - contract], *ws[2 + contract:])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_row_tiles_and_output_tiles(monkeypatch):
    # 1,100 rows over tiles of 1,024; a [128, 2048] weight in blocks of 128 x 512 (4 output tiles); bf16 in and out
    monkeypatch.setattr(dense_pallas, "BLOCK_BYTES", 128 * 512 * 2)
    x = jax.random.normal(jax.random.key(2), (1100, 128), jnp.bfloat16)
    w = LayerOf(jax.random.normal(jax.random.key(3), (2, 3, 128, 2048), jnp.bfloat16), layer_index(0, 1))
    y = dense_pallas.stacked_linear(x, w, 1, interpret=True)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(get("dense", "xla")(x, w, 1), np.float32),
                               rtol=2e-2, atol=2e-2)


def test_the_float32_result_when_asked():
    x = jax.random.normal(jax.random.key(4), (4, 256), jnp.bfloat16)
    w = LayerOf(jax.random.normal(jax.random.key(5), (1, 1, 256, 128), jnp.bfloat16), layer_index(0, 0))
    assert dense_pallas.stacked_linear(x, w, 1, jnp.float32, interpret=True).dtype == jnp.float32


def test_it_reads_stacks_and_the_twin_does_not():
    assert getattr(get("dense", "pallas", "tpu"), "reads_stacked", False)
    assert not getattr(get("dense", "xla"), "reads_stacked", False)
