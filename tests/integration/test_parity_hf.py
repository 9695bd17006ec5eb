"""Our model against HF transformers (the reference of the references), on tiny random checkpoints.

One ragged batch per model type covers: batch > 1 with different row lengths, sequence lengths below, at and
above multiples of the GDN chunk (5, 64, 65, 130), 2 query heads per KV head, 2 value heads per key head, and
key/value head dims that differ (16 / 24). Every zero-centred norm, the gated norm, A_log and dt_bias are
perturbed away from their initial values by the factory.
"""

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from qwen35_lib import forward, load_hf_checkpoint  # noqa: E402
from qwen35_lib.testing import make_hf_model, save_hf_checkpoint  # noqa: E402

pytestmark = pytest.mark.reference
LENGTHS = [130, 65, 64, 5]


def _hf_rows(model, ids, lengths):
    """HF logits for each row on its own (no padding involved), float32 numpy."""
    with torch.no_grad():
        return [model(torch.as_tensor(ids[b : b + 1, :n])).logits[0].float().numpy() for b, n in enumerate(lengths)]


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def case(request, tmp_path_factory):
    model = make_hf_model(request.param, seed=1)
    path = save_hf_checkpoint(model, tmp_path_factory.mktemp(request.param), "per_expert")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (len(LENGTHS), max(LENGTHS)))
    return model, path, ids


def test_float32_logits_match_transformers(case):
    model, path, ids = case
    config, weights = load_hf_checkpoint(path)
    assert config.dtype == "float32"
    ours = np.asarray(forward(config, weights, ids, LENGTHS))
    for b, (ref, n) in enumerate(zip(_hf_rows(model, ids, LENGTHS), LENGTHS)):
        err = np.abs(ours[b, :n] - ref).max()
        assert err <= 1e-4, f"row {b} (length {n}): max |Δlogits| = {err:.2e}"


def test_bfloat16_run_is_as_close_as_transformers_own_bfloat16(case):
    """Tolerance: our bf16 logits sit no further from the float32 reference than HF's own bf16 run does (x2).

    bf16 keeps 8 significant bits, so each rounding is up to 2^-9 relative; how those add up over the layers
    depends on the model, which is why the bound is set by the reference's own bf16 error, not a constant.
    """
    model, path, ids = case
    config, weights = load_hf_checkpoint(path, dtype="bfloat16")
    ours = np.asarray(forward(config, weights, ids, LENGTHS))
    ref32 = _hf_rows(model, ids, LENGTHS)
    ref16 = _hf_rows(model.to(torch.bfloat16), ids, LENGTHS)
    model.float()
    for b, n in enumerate(LENGTHS):
        ours_err = np.abs(ours[b, :n] - ref32[b]).max()
        hf_err = np.abs(ref16[b] - ref32[b]).max()
        assert ours_err <= 2 * hf_err + 1e-3, f"row {b}: ours {ours_err:.3e} vs transformers bf16 {hf_err:.3e}"


@pytest.mark.parametrize("fp8", ["keep", "dequantize"])
def test_fp8_checkpoint_matches_its_dequantized_twin_in_transformers(tmp_path, fp8):
    """Block-scaled FP8 end to end: our forward on the FP8 checkpoint (experts kept in FP8, or everything
    dequantized on load) against transformers running the FP8-rounded weights in float32."""
    from qwen35_lib.testing import fp8_round_trip

    model = make_hf_model("qwen3_5_moe", seed=2)
    config, weights = load_hf_checkpoint(save_hf_checkpoint(model, tmp_path / "fp8", "fp8"), fp8=fp8)
    assert (config.expert_dtype == "float8_e4m3fn") == (fp8 == "keep")
    ids = np.random.default_rng(3).integers(0, config.vocab_size, (1, 70))
    ours = np.asarray(forward(config, weights, ids))[0]
    (ref,) = _hf_rows(fp8_round_trip(model), ids, [70])
    assert np.abs(ours - ref).max() <= 1e-4
