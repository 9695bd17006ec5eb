"""How the ladder's end-to-end gain moves when a labelled assumption is scaled.

`sweep(scales)` scales one assumption of the `tpu7x-8` specs at a time (the others at their data/ values) and
returns, per assumption, [(scale, prefill-heavy gain, decode-heavy gain)], each gain = `kernels` total tokens/s
over `baseline` total tokens/s at 512 concurrent requests. The assumptions are those with no published figure:
per-link ICI bandwidth, core-to-core bandwidth, collective latency (hop + launch), and the efficiency factors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.predict import predict
from qwen35_lib.costmodel.specs import Specs

ASSUMPTIONS: dict[str, Callable[[Specs, float], Specs]] = {
    "ICI link bandwidth": lambda s, k: s.replace(ici_link_bytes_per_s=s.ici_link_bytes_per_s * k),
    "core-to-core bandwidth": lambda s, k: s.replace(core_link_bytes_per_s=s.core_link_bytes_per_s * k),
    "collective latency": lambda s, k: s.replace(hop_latency_s=s.hop_latency_s * k,
                                                 collective_launch_s=s.collective_launch_s * k),
    "HBM efficiency": lambda s, k: s.replace(eff_hbm=min(1.0, s.eff_hbm * k)),
}


def gain(sp: Specs, isl: int, osl: int, concurrency: int = 512, model: str = "qwen3.5-397b-a17b") -> float:
    """`kernels` over `baseline` total tokens/s."""
    run = lambda st: predict(model, sp, st, isl, osl, concurrency, roofline=False)["total_tokens_per_s"]  # noqa: E731
    return run("kernels") / run("baseline")


def sweep(scales: Sequence[float] = (0.25, 1.0, 4.0), hardware: str = "tpu7x-8",
          assumptions: Sequence[str] | None = None) -> dict[str, list[tuple[float, float, float]]]:
    """{assumption: [(scale, 8k/1k gain, 1k/8k gain), ...]} (see the module doc; scale 1 is computed once)."""
    base = specs_lib.get(hardware)
    one = (1.0, gain(base, 8192, 1024), gain(base, 1024, 8192))
    out = {}
    for name in assumptions or ASSUMPTIONS:
        pts = [one if k == 1.0 else (k, gain(ASSUMPTIONS[name](base, k), 8192, 1024),
                                     gain(ASSUMPTIONS[name](base, k), 1024, 8192)) for k in scales]
        out[name] = pts
    return out
