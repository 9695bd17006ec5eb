"""`tp_ep` (tpu-inference's TP8_EP: attention and GDN as `tp_kvrep`, experts as `dp_ep`) through the engine on 2, 4
and 8 of the simulated devices: greedy tokens equal transformers' `generate` on the tiny test checkpoint (issue 55).
One checkpoint and one transformers run for the module; an engine (two step buckets) per device count."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from qwen35_lib.engine.engine import Engine
from qwen35_lib.engine.engine_config import EngineConfig
from qwen35_lib.engine.sampling import SamplingParams
from qwen35_lib.plan import get_layout, make_mesh

pytestmark = pytest.mark.reference
EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=96, page_size=8)
NEW = 4


@pytest.fixture(scope="module")
def checkpoint_and_reference(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from qwen35_lib import load_hf_checkpoint
    from qwen35_lib.testing import make_hf_model, save_hf_checkpoint

    model = make_hf_model("qwen3_5_moe", seed=4)
    path = save_hf_checkpoint(model, tmp_path_factory.mktemp("tp_ep") / "ckpt", "fused")
    cfg, w = load_hf_checkpoint(path)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (70, 5, 12)]  # 70 > a 64-token chunk
    want = []
    with torch.no_grad():
        for p in prompts:
            want.append(model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=list(
                cfg.eos_token_ids), pad_token_id=0)[0, len(p):].tolist())
    return cfg, w, prompts, want


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_tp_ep_greedy_tokens_equal_transformers(devices, checkpoint_and_reference):
    cfg, w, prompts, want = checkpoint_and_reference
    mesh = make_mesh(jax.devices()[:devices])
    engine = Engine(cfg, w, EC, mesh=mesh, plan=get_layout("tp_ep").replace(routing="replicate"))
    assert engine.ec.ranks == 1  # tensor-parallel attention: one rank, every token on every device
    assert [r.output_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=NEW))] == want
