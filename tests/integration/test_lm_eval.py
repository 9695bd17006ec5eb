"""lm-eval (EleutherAI's lm-evaluation-harness) against the server, as an evaluation user drives `vllm serve`:
`local-completions` runs a generate-until task and a loglikelihood (multiple-choice) task, `local-chat-completions`
the generate-until task through the chat template. The tasks are written here (a few JSONL documents and their YAML),
so nothing is downloaded; the scores are checked against the engine and the model run directly: each generation is
the prompt's greedy output run alone (cut at the task's stop string), each choice's log-likelihood the model's own
log-softmax over the continuation, and the accuracy the share of documents whose right choice scores highest.

Spans the server, the scorer and lm-eval's API models, so it lives here (the tiny random model on CPU, a byte-level
tokenizer; lm-eval is a `test` extra)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")  # local-completions counts tokens with the HF tokenizer of the served model

from tests import serve_support  # noqa: E402
from tests.serve_support import MODEL  # noqa: E402

GEN = [{"question": "Q: 2+2=", "answer": "4"}, {"question": "Q: the sky is", "answer": "blue"},
       {"question": "Q: hello", "answer": "world"}]
MC = [{"question": "Colour of grass:", "choices": [" green", " red", " blue"], "label": 0},
      {"question": "One plus one:", "choices": [" two", " three"], "label": 0},
      {"question": "Opposite of hot:", "choices": [" warm", " cold", " hot"], "label": 1}]
STOP = "."


def write_tasks(root: pathlib.Path) -> pathlib.Path:
    """Two lm-eval tasks over local JSONL files: tiny_gen (generate_until, exact match) and tiny_mc
    (multiple_choice: loglikelihood requests, accuracy)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, docs in (("gen", GEN), ("mc", MC)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["{STOP}"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_support.running(tmp_path_factory.mktemp("tok")) as s:
        yield s


@pytest.fixture(scope="module")
def evaluate(tmp_path_factory, monkeypatch_module):
    """lm-eval's `simple_evaluate` over the tasks written here, offline."""
    from lm_eval.tasks import TaskManager

    cache = tmp_path_factory.mktemp("hf")
    for k, v in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_CACHE", str(cache)),
                 ("TRANSFORMERS_OFFLINE", "1")):
        monkeypatch_module.setenv(k, v)
    tasks = TaskManager(include_path=str(write_tasks(tmp_path_factory.mktemp("tasks"))))

    def run(model: str, names: list[str], model_args: dict, **kw) -> dict:
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names, task_manager=tasks,
                                       log_samples=True, **kw)
    return run


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def log_softmax(server, ids: list[int]) -> np.ndarray:
    """The model's log-softmax (float64) over `ids` by its full forward: row t scores token t + 1."""
    from qwen35_lib.model.decoder import forward

    logits = np.asarray(forward(server.config, server.weights, np.asarray([ids], np.int32)), np.float64)[0]
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def expected_generation(server, prompt: str, chat: bool = False) -> str:
    """The greedy answer run alone through the engine, cut at the stop string (as the server cuts it)."""
    ids = server.text.encode_chat([{"role": "user", "content": prompt}]) if chat else server.text.encode(prompt)
    text = server.text.decode(server.alone(ids, 6, ignore_eos=False))
    return text.split(STOP)[0]


def test_local_completions_generate_until_and_loglikelihood_score(server, evaluate):
    out = evaluate("local-completions", ["tiny_gen", "tiny_mc"],
                   dict(model=MODEL, base_url=server.url + "/v1/completions", tokenizer=str(server.tok_dir),
                        tokenizer_backend="huggingface", tokenized_requests=True, max_length=128, num_concurrent=2,
                        max_retries=1))
    gen, mc = out["results"]["tiny_gen"], out["results"]["tiny_mc"]
    assert 0.0 <= gen["exact_match,none"] <= 1.0 and 0.0 <= mc["acc,none"] <= 1.0, out["results"]
    # generate_until: each answer is the engine's greedy output alone, cut at the stop string
    samples = {s["doc"]["question"]: s for s in out["samples"]["tiny_gen"]}
    for d in GEN:
        got = samples[d["question"]]["resps"][0][0]
        assert got == expected_generation(server, d["question"]), d
    assert gen["exact_match,none"] == np.mean([samples[d["question"]]["resps"][0][0] == d["answer"] for d in GEN])
    # loglikelihood: each choice's score is the model's log-probability of its tokens after the question
    right = []
    for s in out["samples"]["tiny_mc"]:
        d = s["doc"]
        scores = []
        for (ll, _greedy), (context, continuation) in zip((r[0] for r in s["resps"]), s["arguments"]):
            assert continuation.endswith(d["choices"][len(scores)])  # lm-eval's " " delimiter before each choice
            ctx = server.text.encode(context)
            cont = server.text.encode(context + continuation)[len(ctx):]  # lm-eval's split: the whole, encoded
            ref = log_softmax(server, ctx + cont)
            want = sum(ref[len(ctx) + i - 1, t] for i, t in enumerate(cont))
            assert abs(ll - want) < 5e-3, (d, continuation, ll, want)
            scores.append(want)
        right.append(int(np.argmax(scores)) == d["label"])
    assert mc["acc,none"] == pytest.approx(np.mean(right))


def test_local_chat_completions_generate_until_scores(server, evaluate):
    out = evaluate("local-chat-completions", ["tiny_gen"],
                   dict(model=MODEL, base_url=server.url + "/v1/chat/completions", max_retries=1),
                   apply_chat_template=True)
    assert 0.0 <= out["results"]["tiny_gen"]["exact_match,none"] <= 1.0
    samples = {s["doc"]["question"]: s for s in out["samples"]["tiny_gen"]}
    for d in GEN:
        assert samples[d["question"]]["resps"][0][0] == expected_generation(server, d["question"], chat=True), d
