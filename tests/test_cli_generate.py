"""`python -m qwen35_lib generate`: the JSON contract, greedy and sampled tokens equal to `Engine.generate` in-process,
EOS from generation_config.json, text prompts through tokenizer.json, and one-line errors with exit status 2.

Cost: compiling is most of it (seconds per engine-step bucket on CPU), so
1. the engine shape admits all four prompts in one step: two buckets per run (one prefill step, then decodes);
2. when a persistent compilation cache is set up (JAX_COMPILATION_CACHE_DIR), every subprocess and this module
   share it; `make test` sets none (jaxlib segfaulted now and then writing CPU executables into one), so each
   CLI run compiles its own two buckets;
3. errors are checked in-process through `main` on a checkpoint (loading compiles nothing), one by subprocess;
4. `--layout dp8_ep8` is one more subprocess, compared with the `single` run the JSON-contract test checks;
5. the two checkpoint runs call `main` in this process (`cli_here`): their engine steps are the ones the in-process
   reference just compiled (same shapes, equal configs), so only the JSON-contract run pays a second process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from qwen35_lib import get_config, init_weights, load_hf_checkpoint
from qwen35_lib.__main__ import main
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[1]
EC = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, page_size=8, max_model_len=160)
ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--page-size", "8", "--max-model-len", "160"]
PROMPTS = [[3, 4, 5], [7, 8], [200, 9, 31, 77, 2, 6], [11]]
REQUEST_KEYS = {"prompt_ids", "output_ids", "finish_reason"}
CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(scope="module", autouse=True)
def cache_env() -> dict:
    """The subprocesses' environment: CPU, and this process's persistent compilation cache settings if it has a
    cache (JAX_COMPILATION_CACHE_DIR...), so that they share it."""
    settings = ({name.upper(): str(getattr(jax.config, name)) for name in CACHE_OPTIONS}
                if jax.config.jax_compilation_cache_dir else {})
    return {**os.environ, "JAX_PLATFORMS": "cpu", **settings}


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen35_lib", "generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """`generate ARGS` through `main` (what the subprocess runs), in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["generate", *args])
    return subprocess.CompletedProcess(["generate", *args], code, out.getvalue(), err.getvalue())


def ids_flags(prompts: list[list[int]]) -> list[str]:
    return [a for p in prompts for a in ("--prompt-ids", " ".join(map(str, p)))]


# --- references -------------------------------------------------------------------------------------------------
TINY = get_config("qwen3.5-tiny", dtype="float32")


def reference(config, weights, prompts, params: SamplingParams) -> list[list[int]]:
    """Output ids per prompt from `Engine.generate` in-process, ignoring EOS. (Configs of the same shapes are
    equal, so every run here shares one compiled step per bucket, in-process and, via the cache, in the CLI.)"""
    results = Engine(config, weights, EC).generate(prompts, dataclasses.replace(params, ignore_eos=True))
    return [r.output_ids for r in results]


def until_eos(outputs: list[list[int]], eos: tuple[int, ...]) -> list[tuple[list[int], str]]:
    """(output_ids, finish_reason) that a run stopping on `eos` gives: cut after the first EOS token."""
    out = []
    for ids in outputs:
        cut = next((i for i, t in enumerate(ids) if t in eos), None)
        out.append((ids, "length") if cut is None else (ids[: cut + 1], "eos"))
    return out


def streamed(stderr: str) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for m in re.finditer(r"^\[req (\d+)\] (\d+)", stderr, re.M):
        tokens.setdefault(int(m[1]), []).append(int(m[2]))
    return tokens


# --- checkpoints ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    pytest.importorskip("transformers")
    from qwen35_lib.testing import make_hf_model, save_hf_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {t: save_hf_checkpoint(make_hf_model(t, seed=1), root / t, "fused") for t in ("qwen3_5_moe", "qwen3_next")}


def write_tokenizer(path: pathlib.Path) -> None:
    """A WordLevel tokenizer: word `w{i}` is token i, for the whole vocabulary of 256."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def set_eos(path: pathlib.Path, eos: int) -> None:
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": eos}))


# --- runs -------------------------------------------------------------------------------------------------------
RANDOM_RUN = [*ids_flags(PROMPTS), "--max-new-tokens", "5", "--dtype", "float32", "--json", *ENGINE_FLAGS]


@pytest.fixture(scope="module")
def single_run(cache_env) -> subprocess.CompletedProcess:
    return cli(cache_env, *RANDOM_RUN)


def test_random_preset_json_contract(single_run):
    out = single_run
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # exactly one JSON document
    assert doc["model"] == "qwen3.5-tiny" and doc["checkpoint"] is None and doc["layout"] == "single"
    assert doc["eos_token_ids"] == [1] and doc["sampling"]["temperature"] == 0.0
    assert {"steps", "traces", "preemptions"} <= doc["stats"].keys() and doc["stats"]["steps"] >= 5
    expected = until_eos(reference(TINY, init_weights(TINY, 0), PROMPTS, SamplingParams(max_new_tokens=5)), (1,))
    assert [r.keys() for r in doc["requests"]] == [REQUEST_KEYS] * len(PROMPTS)  # no text without a tokenizer
    assert [r["prompt_ids"] for r in doc["requests"]] == PROMPTS  # input order, output_ids without the prompt
    assert [(r["output_ids"], r["finish_reason"]) for r in doc["requests"]] == expected
    assert streamed(out.stderr) == {i: r["output_ids"] for i, r in enumerate(doc["requests"])}


def test_checkpoint_eos_and_text_prompts(checkpoints):
    """Qwen3.5: EOS set to a token the greedy model produces ends that request there (EOS included); a --prompt
    goes through tokenizer.json, in input order among the --prompt-ids; every request gets its decoded text."""
    path = checkpoints["qwen3_5_moe"]
    config, weights = load_hf_checkpoint(path)
    prompts = PROMPTS[:2] + [[5, 17, 3]] + PROMPTS[2:3]  # the third as text: "w5 w17 w3"
    outputs = reference(config, weights, prompts, SamplingParams(max_new_tokens=6))
    eos = next(t for i, t in enumerate(outputs[0]) if i >= 2 and t not in outputs[0][:i])  # ends request 0 there
    expected = until_eos(outputs, (eos,))
    assert {reason for _, reason in expected} == {"eos", "length"}
    set_eos(path, eos)
    write_tokenizer(path)

    out = cli_here("--checkpoint", str(path), *ids_flags(PROMPTS[:2]), "--prompt", "w5 w17 w3",
              *ids_flags(PROMPTS[2:3]), "--max-new-tokens", "6", "--json", *ENGINE_FLAGS)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["eos_token_ids"] == [eos] and doc["checkpoint"] == str(path)
    assert [r.keys() for r in doc["requests"]] == [REQUEST_KEYS | {"text"}] * 4
    assert [r["prompt_ids"] for r in doc["requests"]] == prompts
    assert [(r["output_ids"], r["finish_reason"]) for r in doc["requests"]] == expected
    assert [r["text"] for r in doc["requests"]] == [" ".join(f"w{t}" for t in ids) for ids, _ in expected]
    assert f"[req 0] {eos} ' w{eos}'" in out.stderr  # streamed with its new text (incremental decode)


def test_qwen3_next_sampled_text_summary(checkpoints):
    """Qwen3-Next, sampled (per-request seeds make it reproducible in-process), the readable summary."""
    path = checkpoints["qwen3_next"]
    config, weights = load_hf_checkpoint(path)
    params = SamplingParams(max_new_tokens=4, temperature=0.8, top_k=5, seed=7)
    expected = until_eos(reference(config, weights, PROMPTS, params), config.eos_token_ids)

    out = cli_here("--checkpoint", str(path), *ids_flags(PROMPTS), "--max-new-tokens", "4", "--temperature",
              "0.8", "--top-k", "5", "--seed", "7", *ENGINE_FLAGS)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\[(\d)\] (\d+) prompt tokens -> \d+ tokens \((\w+)\):([\d ]*)$", out.stdout, re.M)
    assert [(int(i), int(n), [int(t) for t in ids.split()], reason) for i, n, reason, ids in rows] == \
           [(i, len(p), ids, reason) for i, (p, (ids, reason)) in enumerate(zip(PROMPTS, expected))]
    assert "temperature 0.8, top-k 5" in out.stdout and " steps, " in out.stdout


def test_layout_dp8_ep8_matches_single(cache_env, single_run):
    """8 data-parallel ranks, experts over 8 devices: the greedy tokens of one device. No device count is given
    (the test runner's XLA_FLAGS removed): the CLI makes the 8 CPU devices itself."""
    flags = " ".join(f for f in cache_env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    out = cli({**cache_env, "XLA_FLAGS": flags}, *RANDOM_RUN, "--layout", "dp8_ep8", "--routing", "replicate",
              "--fuse-allgather")
    assert out.returncode == 0, out.stderr
    doc, single = json.loads(out.stdout), json.loads(single_run.stdout)
    assert (doc["layout"], doc["routing"], doc["fuse_allgather"], doc["engine"]["ranks"]) == \
           ("dp8_ep8", "replicate", True, 8)
    assert doc["requests"] == single["requests"]
    assert "layout dp8_ep8 on 8 cpu devices" in out.stderr


# --- errors -----------------------------------------------------------------------------------------------------
def test_bad_token_id_exits_2_with_one_line(cache_env, checkpoints):
    out = cli(cache_env, "--checkpoint", str(checkpoints["qwen3_next"]), "--prompt-ids", "1 256", "--json")
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == "error: token id 256 is outside the vocabulary [0, 256)"


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", ""], "empty prompt"),
    (["--prompt-ids", "1 2 x"], "'x' is not an integer token id"),
    (["--prompt-ids", "-1"], "token id -1 is outside the vocabulary"),
    (["--prompt-ids", " ".join(["5"] * 150), "--max-new-tokens", "20"], "exceeds max_model_len=160"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--prompt", "w1 w2"], "has no tokenizer.json"),
    ([], "no prompts"),
    (["--prompt-ids", "1", "--layout", "tp8"], "2 KV heads cannot be split over 8 devices"),
    (["--prompt-ids", "1", "--layout", "tp8_kvrep", "--fuse-allgather"], "apply to EP layouts"),
    (["--prompt-ids", "1", "--layout", "dp8_ep8", "--routing", "all_to_all", "--hierarchical-rs"],
     "apply to routing='replicate' only"),
    (["--prompt-ids", "1", "--hierarchical-rs"], "layout 'single' has no collectives"),
    (["--prompt-ids", "1", "--max-model-len", "0"], "max_model_len must be >= 1"),
])
def test_bad_input_names_the_problem(checkpoints, capsys, args, message):
    """In-process (`main` is what the subprocess runs): loading a tiny checkpoint compiles nothing."""
    assert main(["generate", "--checkpoint", str(checkpoints["qwen3_next"]), "--max-model-len", "160", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "/nonexistent/ckpt", "--prompt-ids", "1"], "checkpoint directory /nonexistent/ckpt does not"),
    (["--prompt", "hello"], "a random preset has no tokenizer"),
    (["--model", "qwen3.5-tiny", "--checkpoint", ".", "--prompt-ids", "1"], "exclusive"),
])
def test_bad_model_names_the_problem(capsys, args, message):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err


# --- --no-check-weights -----------------------------------------------------------------------------------------
@pytest.fixture()
def config_only(tmp_path) -> pathlib.Path:
    """A checkpoint folder whose config.json is all the CLI reads before the loader is called."""
    from tests.test_cli_errors import TINY_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path


@pytest.mark.parametrize("flags, passed", [([], True), (["--no-check-weights"], False)])
def test_no_check_weights_reaches_a_loader_that_checks(config_only, monkeypatch, capsys, flags, passed):
    def loader(path, *, dtype=None, mesh=None, check_weights=True, **split):
        raise ValueError(f"stub loader: check_weights={check_weights}")

    monkeypatch.setattr("qwen35_lib.checkpoint.load_hf_checkpoint", loader)
    assert main(["generate", "--checkpoint", str(config_only), "--prompt-ids", "1 2", *flags]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: stub loader: check_weights={passed}"


# --- load and progress (shared with `serve`) -------------------------------------------------------------------
def test_load_draws_the_seeded_preset_and_progress_is_a_comment_line(capsys):
    """No checkpoint: the preset in the asked dtype with `init_weights` at the fixed seed (the same values under
    every layout); a checkpoint goes to the loader with the plan and mesh."""
    from qwen35_lib import cli_generate
    from qwen35_lib.plan import SINGLE

    config, weights = cli_generate.load(None, "qwen3.5-tiny", "float32", SINGLE, None)
    assert config == get_config("qwen3.5-tiny", dtype="float32")
    want = init_weights(config, cli_generate.RANDOM_WEIGHTS_SEED)
    assert all((a == b).all() for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(want)))
    cli_generate.progress("loading x")
    assert capsys.readouterr().err == "# loading x\n"


def test_load_hands_a_checkpoint_to_the_loader(monkeypatch, tmp_path):
    from qwen35_lib import cli_generate

    seen = {}
    monkeypatch.setattr("qwen35_lib.checkpoint.load_hf_checkpoint", lambda path, **kw: seen.update(path=path, **kw)
                        or ("config", "weights"))
    assert cli_generate.load(tmp_path, "ignored", None, "plan", "mesh", False, fp8="keep", name="org/m") == (
        "config", "weights")
    assert seen == dict(path=tmp_path, dtype=None, mesh="mesh", layout="plan", fp8="keep", name="org/m",
                        check_weights=False)


def test_speculative_tokens_give_the_same_greedy_output(single_run, checkpoints):
    """--speculative-tokens 2 on the random preset (its random MTP head) prints the run without it; a checkpoint
    without a head is refused in one line, before generating."""
    out = cli_here(*RANDOM_RUN, "--speculative-tokens", "2")
    assert out.returncode == 0, out.stderr
    want = json.loads(single_run.stdout)["requests"]
    assert [r["output_ids"] for r in json.loads(out.stdout)["requests"]] == [r["output_ids"] for r in want]
    out = cli_here("--checkpoint", str(checkpoints["qwen3_next"]), "--prompt-ids", "1 2", "--max-model-len", "160",
                   "--speculative-tokens", "2")
    assert out.returncode == 2 and "has none (no mtp.* tensors)" in out.stderr
    assert len([ln for ln in out.stderr.splitlines() if ln.startswith("error")]) <= 1
