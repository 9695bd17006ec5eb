"""The 397B verify step compiled for TPU7x-8 at full depth (data/aot/tpu7x-8-mtp.json, written by `python -m
qwen35_lib.aot verify`): what fits in the compiler's 94.75 GiB, and the GDN checkpoints' bytes as the cost model
states them (issue 54, item 4b). Reads the stored document; compiles nothing."""

from __future__ import annotations

import pytest

from qwen35_lib import data
from qwen35_lib.aot import sweep, verify
from qwen35_lib.costmodel import ops

DOC = data.read_json("aot/tpu7x-8-mtp.json")
CFG = sweep.serving_config(DOC["model"])


def _shape(requests: int) -> sweep.ServingShape:
    return sweep.ServingShape(requests=requests, **DOC["shape"])


def test_the_document_is_the_serving_shape_at_full_depth():
    assert DOC["groups"] == CFG.num_groups == 15 and DOC["stage"] == "kernels"
    assert DOC["usable_bytes"] == round(94.75 * 2**30)
    assert {k: v for k, v in vars(sweep.SERVING).items() if k != "requests"} == DOC["shape"]
    for e in DOC["verify"].values():  # the engine's verify kernels under the kernels stage's layout (the Pallas
        # GDN's verify kernel, `gdn_pallas._verify_call`; the attention by items)
        assert e["kernels"] == {"attention": "items", "gdn": "pallas", "moe_matmul": "pallas", "dense": "pallas"}
        assert e.get("cache_pool_copies", 0) == 0  # the pools updated in place (the XLA twin's copied 9 at k = 1)


def test_one_draft_fits_at_512_requests_and_three_only_with_fewer():
    one = DOC["verify"][verify.key(1, 512)]
    assert one["fits"] and one["fits_with_head"] and one["total_bytes"] <= DOC["usable_bytes"]
    three = DOC["verify"][verify.key(3, 512)]
    assert not three["fits"] and "RESOURCE_EXHAUSTED" in three["error"]
    # refused by its resident bytes alone: weights, KV and the GDN pools with 4 checkpoints a slot
    assert three["weight_bytes"] + three["kv_bytes"] + three["gdn_state_bytes"] > DOC["usable_bytes"]
    fewer = DOC["verify"][verify.key(3, 384)]
    assert fewer["fits"] and fewer["fits_with_head"]


@pytest.mark.parametrize("name", sorted(DOC["verify"]))
def test_the_checkpoints_bytes_are_the_cost_models(name):
    """Per device: the compile's GDN pools (its abstract caches' shards, which its argument bytes hold) equal the cost
    model's (`costmodel.predict.resident_bytes_per_device`, read again now), and what the checkpoints add over the
    pools without them is k + 1 states and a conv window of K - 1 + k + 1 inputs a slot in each GDN layer
    (`ops.checkpoint_bytes`)."""
    e = DOC["verify"][name]
    k, n = e["speculative_tokens"], e["requests"]
    model = verify.model_bytes(CFG, DOC["stage"], _shape(n), k)
    assert model == e["model"]
    assert e["gdn_state_bytes"] == model["gdn_state_bytes"] and e["kv_bytes"] == model["kv_bytes"]
    plain = verify.model_bytes(CFG, DOC["stage"], _shape(n), 0)
    slots = n // e["ranks"] + 1  # a rank's sequences and the null slot, one rank a device
    added = slots * ops.sizes(CFG)["n_gdn"] * ops.checkpoint_bytes(CFG, k)
    assert model["gdn_state_bytes"] - plain["gdn_state_bytes"] == pytest.approx(added, rel=1e-9)
    if "argument_bytes" in e:  # the compiled arguments: weights and caches, and the step's inputs (< 1 GiB)
        resident = e["weight_bytes"] + e["kv_bytes"] + e["gdn_state_bytes"]
        assert 0 <= e["argument_bytes"] - resident < 2**30


def test_the_cost_models_capacity_with_three_drafts_against_the_compiles():
    """The cost model's capacity (resident bytes only: weights, pools, the head; not the step's temporaries) at k = 3
    and 9,216 tokens a request is 50 a rank; compiled, 50 a rank fits the verify program alone (0.14 GiB spare)
    but not beside the head's weights and KV pool, 48 a rank fits with them: the model is 2 requests a rank high."""
    from qwen35_lib.costmodel.predict import predict

    r = predict(stage="kernels", isl=8192, osl=1024, concurrency=1, num_prompts=1, speculative_tokens=3,
                roofline=False)
    assert r["max_running_per_rank"] == 50
    at50, at48 = DOC["verify"][verify.key(3, 400)], DOC["verify"][verify.key(3, 384)]
    assert at50["fits"] and not at50["fits_with_head"] and at48["fits_with_head"]
