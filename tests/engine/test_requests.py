"""engine.requests: a request checked without weights (the prompt a 1-D sequence of ids in the vocabulary, within
max_model_len), the tokens that end it, and a result's timings. The engine's refusals through `add_request` and
`generate`: test_engine.py."""

import numpy as np
import pytest

from qwen35_lib import get_config
from qwen35_lib.engine import EngineConfig, SamplingParams
from qwen35_lib.engine.requests import Result, stop_set, validate_request

CFG = get_config("qwen3.5-tiny", dtype="float32", eos_token_ids=(5,))
EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, page_size=8, max_model_len=64)


@pytest.mark.parametrize("prompt, error, match", [
    ([], ValueError, "empty prompt"),
    ([1, 256], ValueError, r"token id 256 is outside the vocabulary \[0, 256\)"),
    ([[1, 2]], ValueError, "element 0 is a nested sequence"),
    (np.array([1.5]), ValueError, "got float64 values"),
    ([1] * 60, ValueError, "prompt of 60 tokens \\+ max_new_tokens=16 = 76 exceeds max_model_len=64"),
])
def test_validate_request_names_what_is_wrong(prompt, error, match):
    with pytest.raises(error, match=match):
        validate_request(CFG, EC, prompt, SamplingParams())


def test_validate_request_gives_the_prompt_as_ints():
    assert validate_request(CFG, EC, np.array([1, 2], np.int16), SamplingParams()) == [1, 2]
    assert validate_request(CFG, EC, range(3), SamplingParams()) == [0, 1, 2]
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        validate_request(CFG, EC, [1], {"max_new_tokens": 3})


def test_stop_set_is_the_requests_ids_else_the_models_eos_and_none_with_ignore_eos():
    assert stop_set(CFG, SamplingParams()) == {5}
    assert stop_set(CFG, SamplingParams(stop_token_ids=(7, 8))) == {7, 8}
    assert stop_set(CFG, SamplingParams(ignore_eos=True)) == frozenset()


def test_result_timings():
    r = Result(0, [1], [2, 3, 4], "length", arrival=1.0, token_times=[1.5, 2.0, 3.5], preemptions=0)
    assert r.ttft == 0.5 and r.tpot == 1.0
    assert Result(0, [1], [2], "eos", 1.0, [1.25], 0).tpot == 0.0
