"""A made-up system with round numbers (`toy`) for the cost model's hand-computed tests, and a schedule's steps
(`BATCHES`: decode, mixed, prefill-only, a small padded decode) that the tests time at once."""

from __future__ import annotations

from qwen35_lib.costmodel import specs
from qwen35_lib.costmodel.ops import Batch

GB = 1e9


def toy(chips: int = 4, cores: int = 1, **changes) -> specs.Specs:
    """A made-up system with round numbers, so every expected value below is hand arithmetic."""
    base = dict(name="toy", kind="tpu", chip="toy", chips=chips, devices_per_chip=cores, peak_flops=100e12,
                hbm_bytes_per_s=1e12, hbm_bytes=64 * 2**30, usable_hbm_bytes=63 * 2**30, ici_link_bytes_per_s=100 * GB,
                links_per_neighbour=1, core_link_bytes_per_s=400 * GB if cores > 1 else None, ring="ring",
                hop_latency_s=1e-6,
                collective_launch_s=5e-6, eff_matmul=0.5, eff_hbm=0.8, eff_ici=1.0, vector_fraction=0.1)
    base.update(changes)
    return specs.Specs(**base)


BATCHES = (Batch(decodes=512, decode_ctx=4000, max_ctx=9000, padded_tokens=512, logit_rows=512),
           Batch(decodes=256, decode_ctx=3000, prefill_tokens=4096, prefill_seqs=4, prefill_ctx=1000, max_ctx=9000),
           Batch(prefill_tokens=8192, prefill_seqs=8, prefill_ctx=2048, max_ctx=9000),
           Batch(decodes=8, decode_ctx=100, max_ctx=200, padded_tokens=128))
