"""What the TPU primer quotes: the hardware the playbook models, read from the library's data files (never typed).

The primer chapter (`chapters/primer.md`) quotes these as the results of a step named `primer`, exactly as a step
chapter quotes its notebook: `{{ result: primer.systems.tpu7x-8.hbm_bytes_per_s_per_chip }}`. Documents:

- `systems.<name>`: `qwen35_lib.hardware.get(name)` (per chip and per device) and the cost model's `Specs` (the ICI
  and latency figures, each a source or a labelled assumption), with the derived ridge points in FLOP per byte;
- `decode.<model>`: one decode step of a model at the sweep's 512 requests: token copies per expert and the FLOP
  per FP8 expert-weight byte they give, next to the ridge.
"""

from __future__ import annotations

from typing import Any

STEP = "primer"
SYSTEMS = ("tpu7x-8", "v6e-8", "v5p-8", "v5e-8")
REQUESTS = 512  # the serving shape of the ladder (qwen35_lib.aot.sweep.SERVING)


def system(name: str) -> dict[str, Any]:
    from qwen35_lib import hardware
    from qwen35_lib.costmodel import specs

    h, s = hardware.get(name), specs.get(name)
    d = {k: v for k, v in h.as_dict().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    d.update(ici_link_bytes_per_s=s.ici_link_bytes_per_s, ring_link_bytes_per_s=s.ring_link_bytes_per_s,
             core_link_bytes_per_s=s.core_link_bytes_per_s, hop_latency_s=s.hop_latency_s,
             hop_latency_us=s.hop_latency_s * 1e6, collective_launch_us=s.collective_launch_s * 1e6)
    bw = h.hbm_bytes_per_s_per_chip
    d["ridge_bf16"] = h.peak_bf16_flops_per_chip / bw
    if h.peak_fp8_flops_per_chip:
        d["ridge_fp8"] = h.peak_fp8_flops_per_chip / bw
    d.update(peak_bf16_tflops_per_chip=h.peak_bf16_flops_per_chip / 1e12, hbm_tb_per_s_per_chip=bw / 1e12,
             ici_link_gb_per_s=s.ici_link_bytes_per_s / 1e9)
    if h.peak_fp8_flops_per_chip:
        d["peak_fp8_tflops_per_chip"] = h.peak_fp8_flops_per_chip / 1e12
    if s.core_link_bytes_per_s:
        d["core_link_gb_per_s"] = s.core_link_bytes_per_s / 1e9
    d["hbm_read_ms_per_gib"] = 2**30 / (bw / h.devices_per_chip) * 1e3  # one device reading 1 GiB of its HBM
    return {k: v for k, v in d.items() if v is not None}


def decode(model: str) -> dict[str, Any]:
    from qwen35_lib.config import get_config

    c = get_config(model)
    copies = REQUESTS * c.num_experts_per_tok / c.num_experts  # token copies an expert sees, on average
    return dict(requests=REQUESTS, experts=c.num_experts, top_k=c.num_experts_per_tok,
                copies_per_expert=copies, flop_per_fp8_byte=2 * copies)  # a multiply-add per weight per copy


def documents() -> dict[str, dict]:
    return dict(systems={n: system(n) for n in SYSTEMS}, decode={m: decode(m) for m in ("qwen3.5-397b-a17b",)})


__all__ = ["STEP", "SYSTEMS", "decode", "documents", "system"]
