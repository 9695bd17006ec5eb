"""`python -m qwen35_lib recipe`: the playbook's stages as tpu-inference (vLLM TPU) settings, and its workloads as
`vllm bench serve` commands; a reader of `vllm bench serve --save-result` files beside the cost model.

    recipe --stage kernels [--hardware tpu7x-8] [--model ...] [--isl 8192 --osl 1024 --concurrency 64] [--json]
    recipe --layout tp8_ep8 | dp4_tp2_ep8 | dp8_ep8 | tp8_kvrep | auto [--isl ... --osl ... --concurrency ...]
    recipe --bench [--base-url URL] [--concurrency 512 ...] [--scale 1]
    recipe --result FILE.json ... [--stage kernels] [--json PATH]

The mapping is data (`qwen35_lib/data/recipes.json`): the base command is tpu-inference's InferenceX Qwen3.5 server
script with a sharding preset; a stage sets environment variables or adds and removes flags; every setting
carries the source it was read from. Nothing here was run on a TPU.

`vllm bench serve` draws random lengths uniformly in [L (1 - r), L (1 + r)] (floor and ceil), while the
playbook's workloads (the InferenceX convention) draw [ceil(0.8 L), L]: the command asks for the midpoint M
and one ratio r shared by input and output, the largest (4 decimals) that keeps both ranges within L, so each range
is within a few tokens of the playbook's (printed with the command).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.resources
import json
import math
import pathlib
import shlex
import sys

from qwen35_lib.cli_errors import port, positive

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
RESULT_KEYS = ("completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
               "median_tpot_ms", "max_concurrency")


@functools.cache
def recipes() -> dict:
    """`qwen35_lib/data/recipes.json`, read as package data."""
    return json.loads(importlib.resources.files("qwen35_lib.data").joinpath("recipes.json").read_text())


def _source(key: str) -> str:
    return recipes()["sources"][key]


# --- stages -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ServerRecipe:
    stage: str
    hardware: str
    sharding: str
    dp: int
    env: list[dict]  # {"name", "value", "source", "realises"} in the script's order, the stage's changes applied
    argv: list[str]  # `vllm serve MODEL ...` as the shell passes it
    settings: list[dict]  # every flag with what it realises and its source
    extras: list[dict]  # settings of the stage that the script does not have (printed commented out)
    notes: list[str]
    realises: str
    sglang: list[str] | None  # argv of sglang-jax's equivalent, if it has one
    sglang_note: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"env_dict": {e["name"]: e["value"] for e in self.env}}


def derived(isl: int, osl: int, concurrency: int, dp: int) -> dict[str, int]:
    """The script's derived settings (recipes.json "derived")."""
    return dict(max_model_len=isl + osl + 20, max_num_batched_tokens=min(max(isl // dp, 1024), 2048),
                max_num_seqs=max(1, 2 * concurrency // dp))


def _model_id(model: str | None) -> str:
    models = recipes()["models"]
    if model is None:
        return models["qwen3.5-397b-a17b"]["hf_id"]
    if model in models:
        return models[model]["hf_id"]
    if "/" in model:  # an HF id: passed through
        return model
    raise ValueError(f"no recipe for model {model!r}: give a preset with one ({', '.join(models)}) or an HF id "
                     "such as Qwen/Qwen3.5-397B-A17B-FP8")


def server_recipe(stage: str, hardware: str = "tpu7x-8", model: str | None = None, isl: int | None = None,
                  osl: int | None = None, concurrency: int | None = None, port: int | None = None) -> ServerRecipe:
    """The `vllm serve` command and environment that realise `stage` (a stage, or a layout of recipes.json's
    "layouts": `layout_recipe`) in tpu-inference."""
    doc = recipes()
    if stage not in doc["stages"] and stage not in doc["layouts"]:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(doc['stages'])}; layouts: "
                         f"{', '.join(k for k in doc['layouts'] if not k.startswith('_'))}")
    if hardware not in doc["hardware"]:
        raise ValueError(f"no tpu-inference recipe for hardware {hardware!r}; recipes exist for "
                         f"{', '.join(doc['hardware'])}")
    d = doc["defaults"]
    isl, osl = isl or d["isl"], osl or d["osl"]
    concurrency, port = concurrency or d["concurrency"], port or d["port"]
    st = _entry(stage)
    shard = doc["sharding"][st["sharding"]]
    values = derived(isl, osl, concurrency, shard["dp"]) | dict(port=port)
    env = [dict(e) for e in doc["env"]]
    for name, value in st.get("env", {}).items():  # the stage's environment: replace in place, or append
        hit = next((e for e in env if e["name"] == name), None)
        if hit:
            hit.update(value=value, source="stage", realises=st["realises"])
        else:
            env.append(dict(name=name, value=value, source=st["sources"][0], realises=st["realises"]))
    argv, settings = ["vllm", "serve"], []
    for a in doc["args"]:
        if a["arg"] == "{sharding_args}":
            flags = [f for f in shard["args"] if f not in st.get("args_remove", [])]
            argv += flags
            settings += [dict(arg=f, realises=shard["why"], source=shard["source"]) for f in flags]
            continue
        arg = a["arg"].replace("{model}", "")
        if a.get("key") == "model":
            arg = _model_id(model)
        for k, v in values.items():
            arg = arg.replace("{" + k + "}", str(v))
        argv.append(arg)
        settings.append(dict(arg=arg, realises=a["realises"], source=a["source"]))
    argv += st.get("args_add", [])
    sg = st.get("sglang_jax")
    sglang = None
    if sg:
        base = doc["sglang_jax"]["command"].replace("{model}", _model_id(model))
        sglang = shlex.split(base) + sg["args"]
    return ServerRecipe(stage, hardware, st["sharding"], shard["dp"], env, argv, settings, st.get("extras", []),
                        st.get("notes", []), st["realises"], sglang,
                        (sg["note"] + "; " if sg else "") + doc["sglang_jax"]["note"])


def _entry(name: str) -> dict:
    """recipes.json's record of a stage, or of a layout (its own, or the stage it is `same_as`)."""
    doc = recipes()
    if name in doc["stages"]:
        return doc["stages"][name]
    lay = doc["layouts"][name]
    return doc["stages"][lay["same_as"]] if "same_as" in lay else lay


LAYOUTS = ("tp8_kvrep", "tp8_ep8", "dp4_tp2_ep8", "dp8_ep8")  # recipes.json "layouts" (`costmodel.choice`'s)


def layout_recipe(layout: str, hardware: str = "tpu7x-8", model: str | None = None, isl: int | None = None,
                  osl: int | None = None, concurrency: int | None = None, port: int | None = None,
                  kernels: str = "pallas") -> tuple[ServerRecipe, dict | None]:
    """(the recipe of `layout`, the cost model's choice or None): `layout` one of LAYOUTS, or "auto": the one
    `costmodel.choice.choose` serves for the workload and concurrency, the candidates priced as tpu-inference's engine
    runs them (with `kernels`: tpu-inference's are Pallas), its `layout_choice` returned beside."""
    choice = None
    if layout == "auto":
        from qwen35_lib.costmodel import choice as choice_lib

        d = recipes()["defaults"]
        doc = choice_lib.choose("qwen3.5-397b-a17b", hardware, isl or d["isl"], osl or d["osl"],
                                concurrency or d["concurrency"], kernels=kernels, roofline=False,
                                layouts=LAYOUTS, engine="tpu-inference")
        choice = doc["layout_choice"]
        if choice["picked"] is None:
            raise ValueError(f"no layout fits this workload on {hardware}: {choice['candidates'][0]['reason']}")
        layout = choice["picked"]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)} or auto")
    r = server_recipe(layout, hardware, model, isl, osl, concurrency, port)
    if choice is not None:
        r.notes = [f"picked by the cost model (costmodel predict --layout auto --kernels {kernels} --engine "
                   f"tpu-inference): {layout} "
                   + (f"over {choice['runner_up']} by {choice['margin']:+.1%} total tokens/s" if choice["runner_up"]
                      else "(the only layout that fits)"), *r.notes]
    return r, choice


def format_recipe(r: ServerRecipe, isl: int, osl: int, concurrency: int) -> str:
    doc = recipes()
    lines = [f"# stage {r.stage!r} on {r.hardware} in tpu-inference (vLLM TPU): {r.realises}",
             f"# workload ISL={isl} OSL={osl} at concurrency {concurrency}; sharding {r.sharding} "
             f"(attention DP {r.dp}); base: {_source('server_sh')}", "#", "# environment:"]
    lines += [f"#   {e['name']}={e['value'].strip()}: {e['realises']} [{e['source']}]" for e in r.env]
    lines.append("# flags:")
    lines += [f"#   {s['arg']}: {s['realises']} [{s['source']}]" for s in r.settings]
    for k, v in doc["derived"].items():
        lines.append(f"#   ({k} = {v['formula']}: {v['why']})")
    lines += [f"# note: {n}" for n in r.notes]
    lines.append("")
    lines += [f"export {e['name']}={shlex.quote(e['value'])}" for e in r.env]
    lines.append(" \\\n  ".join([" ".join(r.argv[:3])] + [shlex.quote(a) for a in r.argv[3:]]))
    if r.extras:
        lines += ["", "# part of the playbook's stage but not of the InferenceX script (uncomment to add):"]
        for x in r.extras:
            what = f"export {x['env']}" if "env" in x else f"(add the flag) {x['arg']}"
            lines.append(f"# {what}    # {x['realises']} [{x['source']}]")
    lines += ["", f"# sglang-jax: {r.sglang_note}"]
    lines.append(" ".join(shlex.quote(a) for a in r.sglang) if r.sglang else "# (no sglang-jax equivalent)")
    used = sorted({e["source"] for e in r.env} | {s["source"] for s in r.settings} |
                  {x["source"] for x in r.extras} | {k for e in r.env + r.extras for k in [e.get("also")] if k} |
                  set(_entry(r.stage)["sources"]) | set(doc["sglang_jax"]["sources"] if r.sglang else ()))
    lines += ["", "# sources:"] + [f"#   [{k}] {doc['sources'][k]}" for k in used if k in doc["sources"]]
    return "\n".join(lines)


# --- vllm bench serve -------------------------------------------------------------------------------------------
def vllm_bounds(length: int, ratio: float) -> tuple[int, int]:
    """The range `vllm bench serve --dataset-name random` draws for --random-*-len L and ratio r (its
    random dataset: floor(L (1 - r)), ceil(L (1 + r)); a Qwen tokenizer adds no special tokens)."""
    return max(math.floor(length * (1 - ratio)), 1), math.ceil(length * (1 + ratio))


def vllm_lengths(in_range: tuple[int, int], out_range: tuple[int, int]) -> tuple[int, int, float]:
    """(input midpoint, output midpoint, shared ratio r): the largest r (4 decimals) keeping both within range."""
    mids = [round((lo + hi) / 2) for lo, hi in (in_range, out_range)]
    r = min(hi / m - 1 for m, (_, hi) in zip(mids, (in_range, out_range)))
    r = math.floor(r * 1e4) / 1e4
    return mids[0], mids[1], r


def bench_commands(base_url: str = "http://127.0.0.1:8000", model: str | None = None, tokenizer: str | None = None,
                   concurrencies: tuple[int, ...] = (512,), scale: str = "1",
                   result_dir: str = "build/bench/vllm") -> list[dict]:
    """One `vllm bench serve` command per playbook workload and concurrency (InferenceX conventions, as
    tpu-inference's bench.sh runs them: 10 x CONC prompts, 2 x CONC warm-ups, request rate inf, EOS ignored,
    the chat template applied by sending to the chat endpoint)."""
    from qwen35_lib.bench import workloads

    model_id = _model_id(model)
    rows = []
    for name in workloads.load():
        w = workloads.scaled(name, scale)
        want_in, want_out = w.bounds(w.input_len), w.bounds(w.output_len)
        m_in, m_out, r = vllm_lengths(want_in, want_out)
        for conc in concurrencies:
            tag = f"qwen35_{name.replace('/', '')}_conc{conc}" + ("" if w.scale == "1" else f"_scale{w.scale}")
            argv = ["vllm", "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                    "--base-url", base_url, "--model", model_id, "--tokenizer", tokenizer or model_id,
                    "--dataset-name", "random", "--random-input-len", str(m_in), "--random-output-len", str(m_out),
                    "--random-range-ratio", str(r), "--num-prompts", str(10 * conc), "--max-concurrency", str(conc),
                    "--request-rate", "inf", "--ignore-eos", "--num-warmups", str(2 * conc),
                    "--percentile-metrics", PERCENTILE_METRICS, "--save-result", "--result-dir", result_dir,
                    "--result-filename", tag.replace("/", "-") + ".json",
                    "--metadata", f"workload={name}", f"scale={w.scale}", f"concurrency={conc}"]
            rows.append(dict(workload=name, kind=w.kind, scale=w.scale, concurrency=conc, argv=argv,
                             playbook_input=list(want_in), playbook_output=list(want_out),
                             vllm_input=list(vllm_bounds(m_in, r)), vllm_output=list(vllm_bounds(m_out, r))))
    return rows


def format_bench(rows: list[dict]) -> str:
    lines = ["# The playbook's workloads with vLLM's own client, against any OpenAI-compatible server",
             "# (python -m qwen35_lib serve, or vllm serve). InferenceX conventions as tpu-inference's bench.sh: "
             "random dataset, 10 x CONC prompts,",
             "# 2 x CONC warm-ups, request rate inf, EOS ignored, chat template (the chat endpoint). vLLM's random "
             "dataset draws [L(1-r), L(1+r)]:",
             "# each command asks for the midpoint of the playbook's [ceil(0.8 L), L] (ranges below).",
             f"# source: {_source('bench_sh')}"]
    for r in rows:
        lines += ["", f"# {r['workload']} ({r['kind']}, scale {r['scale']}) at concurrency {r['concurrency']}: "
                      f"input {r['vllm_input']} (playbook {r['playbook_input']}), output {r['vllm_output']} "
                      f"(playbook {r['playbook_output']})",
                  " ".join(shlex.quote(a) for a in r["argv"])]
    return "\n".join(lines)


# --- results ----------------------------------------------------------------------------------------------------
def load_result(path: str | pathlib.Path) -> dict:
    """A `vllm bench serve --save-result` JSON file, checked for the keys the comparison reads."""
    path = pathlib.Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} as a vllm bench serve result: {e}") from None
    missing = [k for k in RESULT_KEYS if k not in doc]
    if missing:
        raise ValueError(f"{path} is not a `vllm bench serve --save-result` file: no {', '.join(missing)} "
                         "(run it with --save-result --percentile-metrics ttft,tpot,itl,e2el)")
    return doc


def compare(result: dict, stage: str = "kernels", hardware: str = "tpu7x-8", model: str = "qwen3.5-397b-a17b",
            source: str = "") -> dict:
    """One results row: the measured figures of a vllm bench result beside `costmodel.predict` for the same
    workload (from the result's --metadata), concurrency and number of prompts."""
    from qwen35_lib.bench import workloads
    from qwen35_lib.costmodel.predict import predict

    name = result.get("workload")
    if name is None:
        raise ValueError(f"{source or 'the result'} has no `workload` (the commands of `recipe --bench` pass "
                         "--metadata workload=8k/1k ...); rerun with that metadata")
    w = workloads.scaled(name, result.get("scale", "1"))
    conc = int(result.get("concurrency") or result["max_concurrency"])
    pred = predict(model, hardware, stage, w.input_len, w.output_len, conc,
                   num_prompts=int(result.get("num_prompts") or result["completed"]))
    measured = {k: result.get(k) for k in ("completed", "failed", "duration", "request_throughput",
                                           "output_throughput", "total_token_throughput", "mean_ttft_ms",
                                           "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                                           "p99_tpot_ms", "median_itl_ms", "median_e2el_ms")}
    row = dict(source=source, workload=name, scale=w.scale, isl=w.input_len, osl=w.output_len, concurrency=conc,
               stage=stage, hardware=hardware, model=pred["model"], measured=measured,
               predicted=dict(output_tokens_per_s=pred.get("output_tokens_per_s"),
                              total_tokens_per_s=pred.get("total_tokens_per_s"), fits=pred["fits"]))
    if pred["fits"]:
        row["measured_over_predicted"] = dict(
            output=result["output_throughput"] / pred["output_tokens_per_s"],
            total=result["total_token_throughput"] / pred["total_tokens_per_s"])
    return row


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'workload':>8} {'conc':>5} {'stage':>9} | {'measured out/s':>14} {'predicted':>10} {'ratio':>6} | "
             f"{'measured tot/s':>14} {'predicted':>10} {'ratio':>6} | {'TTFT p50 ms':>11} {'TPOT p50 ms':>11}"]
    for r in rows:
        m, p, q = r["measured"], r["predicted"], r.get("measured_over_predicted", {})
        lines.append(f"{r['workload']:>8} {r['concurrency']:>5} {r['stage']:>9} | {m['output_throughput']:>14.1f} "
                     f"{p['output_tokens_per_s'] or 0:>10.1f} {q.get('output', 0):>6.2f} | "
                     f"{m['total_token_throughput']:>14.1f} {p['total_tokens_per_s'] or 0:>10.1f} "
                     f"{q.get('total', 0):>6.2f} | {m['median_ttft_ms']:>11.1f} {m['median_tpot_ms']:>11.2f}")
    return "\n".join(lines)


# --- the subcommand ---------------------------------------------------------------------------------------------
def _port(value: str) -> int:
    """A port a printed vLLM command can listen on: 1..65535 (`cli_errors.port` without 0)."""
    n = port(value)
    if n == 0:
        raise argparse.ArgumentTypeError("0 is not a port a command can name: give 1..65535")
    return n


def add_parser(sub: argparse._SubParsersAction) -> None:
    from qwen35_lib.plan import STAGES

    p = sub.add_parser("recipe", help="a stage as tpu-inference / sglang-jax settings; the workloads as vllm bench "
                                      "serve commands; vllm bench results beside the cost model",
                       description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=list(STAGES), help="print the vllm serve command that realises it; with "
                                                         "--result: the stage the measured server ran (kernels)")
    p.add_argument("--layout", choices=(*LAYOUTS, "auto"),
                   help="print the vllm serve command of a layout (tpu-inference's sharding presets), or of the one "
                        "the cost model serves best for --isl, --osl and --concurrency (auto)")
    p.add_argument("--kernels", choices=("xla", "pallas"), default="pallas",
                   help="--layout auto: the kernel family the cost model prices (default: %(default)s, "
                        "tpu-inference's)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--bench", action="store_true", help="print vllm bench serve commands for every workload")
    what.add_argument("--result", action="append", metavar="FILE",
                      help="a vllm bench serve --save-result JSON (repeatable): measured beside predicted")
    p.add_argument("--hardware", default="tpu7x-8", help="the system (recipes: tpu7x-8)")
    p.add_argument("--model", help="a preset with a recipe (qwen3.5-397b-a17b) or an HF id (default: "
                                   "Qwen/Qwen3.5-397B-A17B-FP8)")
    p.add_argument("--isl", type=positive, help="--stage: input length the server is sized for (8192)")
    p.add_argument("--osl", type=positive, help="--stage: output length (1024)")
    p.add_argument("--concurrency", type=positive, action="append",
                   help="--stage: concurrency the server is sized for (64); --bench: repeatable (512)")
    p.add_argument("--port", type=_port, help="--stage: the server's port (8000)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="--bench: the server (%(default)s)")
    p.add_argument("--tokenizer", help="--bench: the tokenizer vllm bench loads (default: the model id)")
    p.add_argument("--scale", default="1", help="--bench: workload length factor, e.g. 1/16 for a CPU server (1)")
    p.add_argument("--result-dir", default="build/bench/vllm", help="--bench: where vllm bench saves results")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="print (or, with --result, write to PATH) one JSON document")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not (args.stage or args.layout or args.bench or args.result):
        raise ValueError("recipe needs --stage NAME, --bench or --result FILE (or --layout NAME|auto)")
    if args.layout and (args.stage or args.bench or args.result):
        raise ValueError("--layout prints a server command alone: drop --stage, --bench and --result")
    if args.layout:
        conc = (args.concurrency or [None])[0]
        r, choice = layout_recipe(args.layout, args.hardware, args.model, args.isl, args.osl, conc, args.port,
                                  args.kernels)
        d = recipes()["defaults"]
        print(json.dumps(dict(r.to_json(), layout_choice=choice), indent=1) if args.json else
              format_recipe(r, args.isl or d["isl"], args.osl or d["osl"], conc or d["concurrency"]))
        return 0
    if args.stage and not (args.bench or args.result):
        conc = (args.concurrency or [None])[0]
        r = server_recipe(args.stage, args.hardware, args.model, args.isl, args.osl, conc, args.port)
        d = recipes()["defaults"]
        print(json.dumps(r.to_json(), indent=1) if args.json else
              format_recipe(r, args.isl or d["isl"], args.osl or d["osl"], conc or d["concurrency"]))
        return 0
    if args.bench:
        rows = bench_commands(args.base_url, args.model, args.tokenizer, tuple(args.concurrency or (512,)),
                              args.scale, args.result_dir)
        print(json.dumps(rows, indent=1) if args.json else format_bench(rows))
        return 0
    stage = args.stage or "kernels"
    rows = [compare(load_result(f), stage, args.hardware, "qwen3.5-397b-a17b", source=str(f)) for f in args.result]
    print(format_rows(rows))
    if args.json:
        from qwen35_lib.bench import default_json_path

        path = pathlib.Path(default_json_path("vllm-bench-serve") if args.json == "-" else args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(benchmark="vllm-bench-serve", rows=rows), indent=1))
        print(f"# wrote {path}", file=sys.stderr)
    return 0
