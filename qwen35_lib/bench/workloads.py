"""Serving workloads: named by input/output lengths (`8k/1k`, `1k/8k`, `1k/1k`), read from `data/workloads.json`.

A request's input and output lengths are drawn uniformly from the integers in [ceil(r * L), L] with r = 0.8 (the
InferenceMAX random-range-ratio convention), seeded; its prompt ids are drawn uniformly from the vocabulary.
At CPU size the lengths are scaled by one factor for both (`cpu_scale`, 1/16: 8k/1k -> 512/64).

    wl = scaled("8k/1k", "1/16")                       # Workload(name='8k/1k', input_len=512, output_len=64, ...)
    requests = draw_requests(wl, 8, seed=0, vocab_size=4096)   # [(prompt_ids, max_new_tokens), ...]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from fractions import Fraction

import numpy as np

from qwen35_lib import data

DATA = data.path("workloads.json")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str  # e.g. "8k/1k" (the unscaled lengths, also when scaled)
    input_len: int  # L_in: the longest prompt (tokens)
    output_len: int  # L_out: the longest output (tokens)
    range_ratio: float = 0.8  # lengths uniform in [ceil(range_ratio * L), L]
    kind: str = ""  # prefill-heavy, decode-heavy, balanced
    scale: str = "1"  # the factor applied to the published lengths

    def bounds(self, length: int) -> tuple[int, int]:
        """The smallest and largest length drawn for a workload length L: [ceil(r * L), L] (at least 1)."""
        return max(1, math.ceil(Fraction(str(self.range_ratio)) * length)), length

    @property
    def max_len(self) -> int:  # the longest request: prompt + output
        return self.input_len + self.output_len

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"input_range": list(self.bounds(self.input_len)),
                                           "output_range": list(self.bounds(self.output_len))}


@functools.cache
def _document(path: str) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def load(path: str | pathlib.Path = DATA) -> dict[str, Workload]:
    """The workloads of `path` (default `data/workloads.json`), by name, unscaled."""
    doc = _document(str(path))
    r = float(doc["range_ratio"])
    return {name: Workload(name, int(w["input_len"]), int(w["output_len"]), r, w.get("kind", ""))
            for name, w in doc["workloads"].items()}


def cpu_scale(path: str | pathlib.Path = DATA) -> str:
    """The documented CPU scale factor, as written in the data file (e.g. "1/16")."""
    return str(_document(str(path))["cpu_scale"])


def max_num_batched_tokens(path: str | pathlib.Path = DATA) -> int:
    """The unscaled engine token budget the published runs used (InferenceMAX: 8192)."""
    return int(_document(str(path))["max_num_batched_tokens"])


def parse_factor(factor: str | float | Fraction) -> Fraction:
    """"1/16", 0.0625, Fraction(1, 16) -> Fraction(1, 16); refuses factors outside (0, 1]."""
    try:
        f = Fraction(factor) if not isinstance(factor, float) else Fraction(factor).limit_denominator(1 << 16)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"scale factor {factor!r} is not a number or a fraction like 1/16") from None
    if not 0 < f <= 1:
        raise ValueError(f"scale factor {factor!r} must be in (0, 1] (e.g. 1/16 for CPU size, 1 for the real lengths)")
    return f


def scaled(name: str, factor: str | float | Fraction = 1, path: str | pathlib.Path = DATA) -> Workload:
    """Workload `name` with both lengths multiplied by `factor` (rounded, at least 1 token)."""
    workloads = load(path)
    if name not in workloads:
        raise ValueError(f"unknown workload {name!r}; available: {', '.join(workloads)}")
    w, f = workloads[name], parse_factor(factor)
    return dataclasses.replace(w, input_len=max(1, round(w.input_len * f)), output_len=max(1, round(w.output_len * f)),
                               scale=str(f))


def draw_lengths(workload: Workload, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """n (input length, output length) pairs, uniform in [ceil(r * L), L] each, seeded."""
    rng = np.random.default_rng(seed)
    lo_in, hi_in = workload.bounds(workload.input_len)
    lo_out, hi_out = workload.bounds(workload.output_len)
    ins = rng.integers(lo_in, hi_in + 1, n)
    outs = rng.integers(lo_out, hi_out + 1, n)
    return [(int(i), int(o)) for i, o in zip(ins, outs)]


def draw_requests(workload: Workload, n: int, seed: int = 0, vocab_size: int = 4096,
                  low: int = 2) -> list[tuple[list[int], int]]:
    """n requests (prompt_ids, max_new_tokens), seeded.

    1. lengths as `draw_lengths(workload, n, seed)`;
    2. prompt ids uniform in [low, vocab_size) from a second stream of the same seed (low = 2 keeps clear of the
       pad id 0 and the tiny/mini models' EOS id 1, which a prompt has no reason to hold).
    """
    if n < 0 or not 0 <= low < vocab_size:
        raise ValueError(f"need n >= 0 and 0 <= low < vocab_size, got n={n}, low={low}, vocab_size={vocab_size}")
    lengths = draw_lengths(workload, n, seed)
    rng = np.random.default_rng([seed, 1])
    return [(rng.integers(low, vocab_size, i).tolist(), o) for i, o in lengths]


def parse_names(text: str, path: str | pathlib.Path = DATA) -> list[str]:
    """"8k/1k, 1k/8k" -> ["8k/1k", "1k/8k"], refusing unknown names."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = load(path)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"unknown or no workloads {bad or text!r}; available: {', '.join(known)}")
    return names


@dataclasses.dataclass(frozen=True)
class RandomLengths:
    """vllm bench serve's random dataset lengths: uniform in [int(L (1 - r)), int(L (1 + r))] (at least 1)."""

    name: str
    input_len: int
    output_len: int
    ratio: float
    scale: str = "1"

    def bounds(self, length: int) -> tuple[int, int]:
        return max(1, int(length * (1 - self.ratio))), max(1, int(length * (1 + self.ratio)))
