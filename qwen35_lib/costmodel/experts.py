"""How many distinct experts a batch touches: the expert weight bytes a step must read.

With top-k routing over E experts, a token picks k distinct experts. If routing is uniform and tokens are
independent, an expert is missed by one token with probability 1 - k/E, so by T tokens with (1 - k/E)^T, and
1. expected distinct experts hit by T tokens = E (1 - (1 - k/E)^T);
2. under expert parallelism over `ep` devices, each device owns E/ep of them: E/ep (1 - (1 - k/E)^T) touched
   per device (each device's experts see every token of the slice, whichever routing moves them there).
Real routers are not uniform: skew makes fewer distinct experts (fewer bytes) but a busier hottest device.
`simulate_distinct` draws the same thing at random, to check the formula.
"""

from __future__ import annotations

import numpy as np


def expected_distinct(tokens: float, num_experts: int, top_k: int) -> float:
    """E (1 - (1 - k/E)^T): distinct experts hit by `tokens` tokens choosing `top_k` of `num_experts` each."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expected_distinct_per_device(tokens: float, num_experts: int, top_k: int, ep: int) -> float:
    """Distinct experts hit among the E/ep a device owns."""
    return expected_distinct(tokens, num_experts, top_k) / ep


def simulate_distinct(tokens: int, num_experts: int, top_k: int, trials: int = 200, seed: int = 0) -> float:
    """Mean distinct experts over `trials` random batches (each token: `top_k` distinct experts uniformly)."""
    rng = np.random.default_rng(seed)
    counts = []
    for _ in range(trials):
        picks = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k]  # [T, k] distinct per token
        counts.append(len(np.unique(picks)))
    return float(np.mean(counts))
