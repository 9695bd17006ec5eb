"""`recipe`: stages as tpu-inference commands (kernels = its InferenceX Qwen3.5 server script, flag for flag),
workloads as `vllm bench serve` commands, and a reader of vllm bench result files beside the cost model."""

from __future__ import annotations

import json
import math
import shlex

import pytest

from qwen35_lib.__main__ import main
from qwen35_lib.plan import STAGES
from qwen35_lib.recipe import bench_commands, recipes, server_recipe, vllm_bounds

# tpu-inference tests/e2e/benchmarking/inferencex/qwen3.5/server.sh at b8692ff (2026-08-22), as bash passes it with
# its defaults SHARDING=DP8_EP ISL=8192 OSL=1024 CONC=64 PORT=8000: MAX_MODEL_LEN = 8192 + 1024 + 20,
# MAX_NUM_BATCHED_TOKENS = min(max(8192 / 8, 1024), 2048), MAX_NUM_SEQS = 64 * 2 / 8.
SERVER_SH_ENV = [
    ("MODEL_IMPL_TYPE", "vllm"), ("MOE_ROUTE_PADDING_TO_EXPERT0", "1"), ("MIN_TOKEN_BUCKET", "8"),
    ("USE_MOE_EP_KERNEL", "0"), ("ATTN_BUCKETIZED_NUM_REQS", "true"), ("ATTN_CUSTOM_NUM_REQS_BUCKETS", "4,8,16,32,64"),
    ("ONEHOT_MOE_PERMUTE_THRESHOLD", "32768"), ("VLLM_MOE_CHUNK_SIZE", "256"),
    ("RAGGED_GATED_DELTA_RULE_IMPL", "chunked_kernel_p_recurrent_kernel_d"), ("NEW_MODEL_DESIGN", "1"),
    ("SLICE_ROPE_CACHE", "1"), ("DP_SCHED_BATCH_PREFILL", "true"),
    ("LIBTPU_INIT_ARGS", " --xla_tpu_use_minor_sharding_for_major_trivial_input=true "
                         "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=false "
                         "--xla_tpu_ars_combiner_threshold_in_bytes=0 --xla_tpu_enable_async_collective_merger=false"),
]
SERVER_SH_ARGV = [
    "vllm", "serve", "Qwen/Qwen3.5-397B-A17B-FP8", "--max-model-len=9236", "--max-num-batched-tokens=1024",
    "--max-num-seqs=16", "--no-enable-prefix-caching", "--gpu-memory-utilization=0.9", "--tensor-parallel-size=8",
    "--async-scheduling", "--port=8000", "--language-model-only", "--enable-auto-tool-choice",
    "--tool-call-parser=qwen3_coder", "--reasoning-parser=qwen3", '--limit-mm-per-prompt={"image": 0, "video": 0}',
    "--kv-cache-dtype=fp8", "--block-size=256",
    '--additional_config={"sharding": {"sharding_strategy": {"enable_dp_attention": true}}}',
    "--enable-expert-parallel",
]


def printed(capsys, *argv: str) -> str:
    assert main(["recipe", *argv]) == 0
    return capsys.readouterr().out


def parse_shell(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The `export NAME=value` lines and the `vllm serve ...` command of a printed recipe, as the shell reads them."""
    env = [tuple(shlex.split(line[len("export "):])[0].split("=", 1)) for line in text.splitlines()
           if line.startswith("export ")]
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("vllm serve "))
    cmd = []
    for line in lines[start:]:
        cmd.append(line.rstrip("\\"))
        if not line.endswith("\\"):
            break
    return env, shlex.split(" ".join(cmd))


def test_kernels_is_the_inferencex_server_script_flag_for_flag(capsys):
    out = printed(capsys, "--stage", "kernels")
    env, argv = parse_shell(out)
    assert env == SERVER_SH_ENV
    assert argv == SERVER_SH_ARGV
    assert "tests/e2e/benchmarking/inferencex/qwen3.5/server.sh" in out
    # the playbook's settings the script leaves off are printed, commented out, with their sources
    assert "# export ENABLE_RS_KERNEL=1" in out and "# export USE_BATCHED_RPA_KERNEL=1" in out
    assert "python -m sgl_jax.launch_server" in out


def test_derived_settings_follow_the_script(capsys):
    _, argv = parse_shell(printed(capsys, "--stage", "kernels", "--isl", "1024", "--osl", "1024",
                                  "--concurrency", "256", "--port", "9000"))
    assert {"--max-model-len=2068", "--max-num-batched-tokens=1024", "--max-num-seqs=64", "--port=9000"} <= set(argv)
    assert "--max-num-batched-tokens=2048" in server_recipe("kernels", isl=32768).argv  # capped at 2048


def test_every_stage_has_a_recipe_with_sources():
    doc = recipes()
    assert set(doc["stages"]) == set(STAGES)
    urls = doc["sources"]
    assert all(u.startswith("https://github.com/") for u in urls.values())
    for item in doc["env"] + doc["args"] + [x for s in doc["stages"].values() for x in s.get("extras", [])]:
        assert item["source"] in urls and item.get("also", item["source"]) in urls, item
    for name in STAGES:
        r = server_recipe(name)
        assert r.argv[:3] == ["vllm", "serve", "Qwen/Qwen3.5-397B-A17B-FP8"] and all(s in urls for s in
                                                                                      doc["stages"][name]["sources"])
    env = lambda s: dict((e["name"], e["value"]) for e in server_recipe(s).env)
    assert env("dp_ep")["USE_MOE_EP_KERNEL"] == "1" and env("replicate")["USE_MOE_EP_KERNEL"] == "0"
    assert env("hier_rs")["ENABLE_RS_KERNEL"] == "1" and "ENABLE_RS_KERNEL" not in env("kernels")
    base = server_recipe("baseline").argv
    assert "--enable-expert-parallel" not in base and any('"enable_dp_attention": false' in a for a in base)
    assert server_recipe("replicate").argv == server_recipe("fused_ag").argv  # no switch for the packed all-gather
    assert server_recipe("hier_rs").sglang is None and "--moe-backend=fused" in server_recipe("dp_ep").sglang


def test_recipe_errors_name_the_fix(capsys):
    with pytest.raises(ValueError, match="recipes exist for tpu7x-8"):
        server_recipe("kernels", hardware="v6e-8")
    with pytest.raises(ValueError, match="or an HF id"):
        server_recipe("kernels", model="qwen3.5-mini")
    assert server_recipe("kernels", model="Qwen/Qwen3.5-397B-A17B").argv[2] == "Qwen/Qwen3.5-397B-A17B"
    assert main(["recipe"]) == 2
    assert "--stage NAME, --bench or --result" in capsys.readouterr().err


def test_bench_commands_follow_inferencex(capsys):
    out = printed(capsys, "--bench", "--concurrency", "64", "--concurrency", "512", "--base-url", "http://h:1")
    cmds = [shlex.split(line) for line in out.splitlines() if line.startswith("vllm bench serve ")]
    assert len(cmds) == 6  # 3 workloads x 2 concurrencies
    rows = bench_commands(concurrencies=(64, 512))
    for cmd, row in zip(cmds, rows):
        opt = {a: cmd[i + 1] for i, a in enumerate(cmd) if a.startswith("--") and i + 1 < len(cmd)}
        conc = row["concurrency"]
        assert cmd == row["argv"][:7] + ["--base-url", "http://h:1"] + row["argv"][9:]
        assert opt["--dataset-name"] == "random" and opt["--request-rate"] == "inf" and "--ignore-eos" in cmd
        assert opt["--num-prompts"] == str(10 * conc) and opt["--num-warmups"] == str(2 * conc)
        assert opt["--max-concurrency"] == str(conc) and "--save-result" in cmd
        assert opt["--endpoint"] == "/v1/chat/completions" and opt["--percentile-metrics"] == "ttft,tpot,itl,e2el"
        # vLLM's reading of the range ratio, applied to the printed lengths, lands within 0.1% of the playbook's
        r = float(opt["--random-range-ratio"])
        for flag, want in (("--random-input-len", row["playbook_input"]), ("--random-output-len",
                                                                           row["playbook_output"])):
            lo, hi = vllm_bounds(int(opt[flag]), r)
            assert hi <= want[1] and math.isclose(lo, want[0], rel_tol=1e-3) and math.isclose(hi, want[1],
                                                                                           rel_tol=1e-3)
    scaled = bench_commands(scale="1/16")
    assert [r["playbook_input"] for r in scaled] == [[410, 512], [52, 64], [52, 64]]


def write_vllm_result(path, **changes) -> dict:
    """A result file with the keys `vllm bench serve --save-result --percentile-metrics ttft,tpot,itl,e2el
    --metadata workload=8k/1k scale=1 concurrency=64` writes (vllm/benchmarks/serve.py)."""
    doc = {"date": "20261201-101500", "endpoint_type": "openai-chat", "backend": "openai-chat", "label": None,
           "model_id": "Qwen/Qwen3.5-397B-A17B-FP8", "tokenizer_id": "Qwen/Qwen3.5-397B-A17B-FP8",
           "num_prompts": 640, "workload": "8k/1k", "scale": "1", "concurrency": "64", "request_rate": "inf",
           "burstiness": 1.0, "max_concurrency": 64, "duration": 300.0, "completed": 640, "failed": 0,
           "total_input_tokens": 4_718_000, "total_output_tokens": 589_000, "request_throughput": 2.13,
           "request_goodput": None, "output_throughput": 1963.3, "total_token_throughput": 17690.0,
           "max_output_tokens_per_s": 2300.0, "max_concurrent_requests": 64, "rtfx": 0.0}
    for m in ("ttft", "tpot", "itl", "e2el"):
        doc |= {f"mean_{m}_ms": 50.0, f"median_{m}_ms": 45.0, f"std_{m}_ms": 5.0, f"p99_{m}_ms": 90.0}
    doc |= changes
    path.write_text(json.dumps(doc))
    return doc


def test_result_reader_puts_vllm_bench_beside_the_cost_model(tmp_path, capsys):
    from qwen35_lib.costmodel.predict import predict

    res = write_vllm_result(tmp_path / "r.json")
    out_json = tmp_path / "rows.json"
    table = printed(capsys, "--result", str(tmp_path / "r.json"), "--stage", "kernels", "--json", str(out_json))
    row = json.loads(out_json.read_text())["rows"][0]
    pred = predict("qwen3.5-397b-a17b", "tpu7x-8", "kernels", 8192, 1024, 64, num_prompts=640)
    assert row["predicted"]["output_tokens_per_s"] == pred["output_tokens_per_s"]
    assert row["measured"]["output_throughput"] == res["output_throughput"]
    assert row["measured"]["median_tpot_ms"] == 45.0 and row["concurrency"] == 64 and row["isl"] == 8192
    assert row["measured_over_predicted"]["total"] == pytest.approx(17690.0 / pred["total_tokens_per_s"])
    assert "8k/1k" in table and f"{res['output_throughput']:.1f}" in table

    bad = write_vllm_result(tmp_path / "bad.json")
    del bad["median_tpot_ms"]  # a run without --percentile-metrics tpot
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert main(["recipe", "--result", str(tmp_path / "bad.json")]) == 2
    assert "no median_tpot_ms" in capsys.readouterr().err


def test_layouts_are_the_sharding_presets_and_auto_serves_the_cost_models_pick(monkeypatch, capsys):
    """`recipe --layout` (issue 55, item 5): each layout `costmodel predict --layout auto` chooses between is
    tpu-inference's sharding preset (TP8_EP with expert parallelism, DP4TP2_EP, DP8_EP = the kernels stage, the naive
    TP8 = the baseline stage); `auto` prints the recipe of the layout the cost model picked, and says so."""
    from qwen35_lib import recipe
    from qwen35_lib.costmodel import choice

    tp_ep, dp4 = server_recipe("tp8_ep8"), server_recipe("dp4_tp2_ep8")
    assert (tp_ep.sharding, tp_ep.dp, dp4.sharding, dp4.dp) == ("TP8_EP", 1, "DP4TP2_EP", 4)
    assert "--enable-expert-parallel" in tp_ep.argv and '"enable_dp_attention": false' in " ".join(tp_ep.argv)
    assert '"attn_dp_size": 4' in " ".join(dp4.argv) and "--max-num-seqs=32" in dp4.argv  # 2 x 64 / 4
    assert server_recipe("dp8_ep8").argv == server_recipe("kernels").argv
    assert server_recipe("tp8_kvrep").argv == server_recipe("baseline").argv
    assert recipes()["sharding"]["TP8_EP"]["playbook_layout"] == "tp8_ep8"
    assert set(recipe.LAYOUTS) == set(choice.CANDIDATES)
    picked = dict(picked="dp4_tp2_ep8", runner_up="tp8_ep8", margin=0.07, by="total_tokens_per_s", candidates=[])
    seen = {}

    def fake(model, hardware, isl, osl, concurrency, **kw):
        seen.update(isl=isl, osl=osl, concurrency=concurrency, kernels=kw["kernels"], engine=kw["engine"])
        return {"layout_choice": picked}

    monkeypatch.setattr(choice, "choose", fake)
    assert main(["recipe", "--layout", "auto", "--isl", "1024", "--osl", "1024", "--concurrency", "32"]) == 0
    out = capsys.readouterr().out
    assert seen == dict(isl=1024, osl=1024, concurrency=32, kernels="pallas", engine="tpu-inference")
    assert "sharding DP4TP2_EP" in out and "picked by the cost model" in out and "over tp8_ep8 by +7.0%" in out
