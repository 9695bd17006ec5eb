"""kernels.dense.native and native.packed: `linear` on a panel-packed weight (the CPU engine's projections) equals
it on the row-major weight, by the handler (few rows) or XLA (more rows, or where the handler cannot run), float32
and bfloat16, one or two contracted dims; what `pack_dense` leaves alone; the CPU engine's weights packed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.kernels.dense import linear
from qwen35_lib.kernels.dense import native as dense_native
from qwen35_lib.kernels.native import build as native
from qwen35_lib.kernels.native import packed
from qwen35_lib.model import decoder, layer_loop
from qwen35_lib.plan import SINGLE

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler: the native kernel cannot be built")


def test_the_library_builds_and_loads():
    assert native.load(dense_native.LIBRARY) is not None, native.unavailable(dense_native.LIBRARY)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 8, 16, 40])  # up to MAX_ROWS the handler, past it XLA's dot
@pytest.mark.parametrize("shape,contract", [((48, 128), 1), ((64, 3, 64), 1), ((4, 12, 192), 2)])
def test_packed_linear_equals_the_row_major_one(shape, contract, rows, dtype):
    kx, kw = jax.random.split(jax.random.key(rows + len(shape)))
    w = (jax.random.normal(kw, shape) / 8).astype(dtype)
    x = jax.random.normal(kx, (1, rows, *shape[:contract])).astype(dtype)
    p = dense_native.pack_dense(w, contract)
    assert isinstance(p, packed.PanelPacked) and p.shape == shape and p.dtype == w.dtype
    run = jax.jit(linear, static_argnums=2)
    got, want = run(x, p, contract), run(x, w, contract)
    assert got.shape == want.shape == (1, rows, *shape[contract:]) and got.dtype == want.dtype
    tol = 1e-5 if dtype == "float32" else 2**-7  # one bf16 rounding of the output apart
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    hlo = run.lower(x, p, contract).as_text()
    assert (dense_native.HANDLER in hlo) == (rows <= dense_native.MAX_ROWS)


@pytest.mark.parametrize("rows", [8, 40])
def test_the_lm_heads_logits_are_float32_from_bfloat16_rows(rows):
    w = (jax.random.normal(jax.random.key(0), (64, 256)) / 8).astype(jnp.bfloat16)
    h = jax.random.normal(jax.random.key(1), (1, rows, 64)).astype(jnp.bfloat16)
    got = jax.jit(lambda h, w: linear(h, w, dtype=jnp.float32))(h, dense_native.pack_dense(w))
    want = jnp.einsum("rsd,dv->rsv", h, w, preferred_element_type=jnp.float32)  # the head before it was packed
    assert got.dtype == jnp.float32 and got.shape == (1, rows, 256)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # float32 both: no bf16 rounding of the logits


def test_off_the_handler_xla_reads_the_panels(monkeypatch):
    w = jax.random.normal(jax.random.key(0), (64, 128))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    p = dense_native.pack_dense(w)
    monkeypatch.setattr(dense_native.build, "ffi_target", lambda *a: None)
    np.testing.assert_allclose(linear(x, p), linear(x, w), atol=1e-5, rtol=1e-5)


def test_what_pack_dense_leaves_alone():
    for w, contract in [(jnp.ones((64, 8)), 1),  # 8 columns: no whole panel
                        (jnp.ones((64, 64), jnp.int32), 1), (jnp.ones((64,)), 1), (jnp.ones((2, 64)), 2)]:
        assert dense_native.pack_dense(w, contract) is w
    with pytest.raises(ValueError, match="contract=1"):
        linear(jnp.ones((2, 4, 16)), dense_native.pack_dense(jnp.ones((4, 16, 64)), 2), 1)


def test_prepare_weights_packs_the_cpu_projections():
    """The per-layer projections with whole panels are packed (`layer_loop.PROJECTIONS`), the others not (tiny's
    shapes: some of each); the weight check reads the logical shapes."""
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(cfg, 0)
    prepared = layer_loop.prepare_weights(cfg, w)
    decoder.check_weights(cfg, prepared)
    gdn, attn = prepared["layers"][0][0].mixer, prepared["layers"][0][3].mixer
    assert isinstance(gdn["w_out"], packed.PanelPacked) and gdn["w_out"].k_dims == 2  # [4, 24 | 64]
    assert not isinstance(gdn["w_v"], packed.PanelPacked)  # [64 | 4, 24]: 96 columns
    assert isinstance(attn["w_q"], packed.PanelPacked) and isinstance(attn["w_o"], packed.PanelPacked)
    head = prepared["lm_head"]  # [64 | 256]: the decode step's LM head on a few rows
    assert isinstance(head, packed.PanelPacked) and head.row_major is w["lm_head"]  # no copy kept for XLA's dot
    other_moe = layer_loop.prepare_weights(cfg, w, SINGLE.replace(moe_kernel="loop"))  # not tied to the MoE kernel
    assert isinstance(other_moe["layers"][0][3].mixer["w_q"], packed.PanelPacked)
