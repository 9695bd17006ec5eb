"""A request as the engine takes it and gives it back: its prompt checked against the model and the engine's knobs
(`validate_request`, one-line errors that say how to fix), the tokens that end it (`stop_set`), and the finished
`Result` with its timings."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import numpy as np

from qwen35_lib.config import Config
from qwen35_lib.engine.engine_config import EngineConfig
from qwen35_lib.engine.sampling import SamplingParams
from qwen35_lib.engine.speculative import check_request


@dataclasses.dataclass
class Result:
    """A finished request."""

    id: int
    prompt_ids: list[int]
    output_ids: list[int]  # without the prompt; with the EOS token if one ended it
    finish_reason: str  # "eos" or "length"
    arrival: float
    token_times: list[float]
    preemptions: int

    @property
    def ttft(self) -> float:  # time to first token (s)
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float:  # mean time per output token after the first (s)
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0


def validate_request(config: Config, ec: EngineConfig, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """The prompt as a list of ints, or a ValueError naming what is wrong with the request and how to fix it.
    Needs no weights: a CLI can check requests before loading a checkpoint."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"a request's params must be a SamplingParams (or None), got {type(params).__name__}")
    prompt = _prompt_ids(prompt_ids)
    if not prompt:
        raise ValueError("empty prompt: a request needs at least one token id")
    bad = [t for t in prompt if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    for what, ids in params.token_ids().items():
        bad = [t for t in ids if t >= config.vocab_size]
        if bad:
            raise ValueError(f"{what} id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    check_request(ec.speculative_tokens, params)
    total = len(prompt) + params.max_new_tokens
    if total > ec.max_model_len:
        raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} = {total} "
                         f"exceeds max_model_len={ec.max_model_len}: shorten the prompt, lower max_new_tokens, "
                         "or build the engine with a larger max_model_len")
    return prompt


def stop_set(config: Config, params: SamplingParams) -> frozenset[int]:
    """The tokens that end a request (finish "eos"): none with ignore_eos, else its stop_token_ids where given,
    else the model's EOS ids."""
    if params.ignore_eos:
        return frozenset()
    return frozenset(params.stop_token_ids if params.stop_token_ids is not None else config.eos_token_ids)


def _prompt_ids(prompt_ids) -> list[int]:
    """A 1-D sequence of integer token ids (list, tuple, range, 1-D integer array) as a list of ints; anything
    else (a string, a nested list, floats, bools) is refused, never flattened or rounded."""
    if hasattr(prompt_ids, "ndim") and hasattr(prompt_ids, "dtype"):  # a numpy or JAX array
        arr = np.asarray(prompt_ids)
        if arr.ndim != 1:
            raise ValueError(f"a prompt is a 1-D sequence of token ids; got an array of shape {arr.shape}: give "
                             "each request its own prompt")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"a prompt is a sequence of integer token ids; got {arr.dtype} values")
        return [int(t) for t in arr]
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise ValueError(f"a prompt is a 1-D sequence of integer token ids; got {type(prompt_ids).__name__} "
                         f"{prompt_ids!r:.40}")
    for i, t in enumerate(prompt_ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            kind = "a nested sequence (give each request its own prompt)" if isinstance(t, (Sequence, np.ndarray)) \
                else f"{type(t).__name__} {t!r:.20}"
            raise ValueError(f"a prompt is a 1-D sequence of integer token ids; element {i} is {kind}")
    return [int(t) for t in prompt_ids]
