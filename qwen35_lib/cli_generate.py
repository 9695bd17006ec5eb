"""`python -m qwen35_lib generate`: run prompts through the serving engine and print the tokens.

The CLI only wires: it parses prompts, builds `SamplingParams` and `EngineConfig`, loads a checkpoint (or makes
seeded random weights for a preset), and calls `Engine.generate`, streaming each token to stderr. Every check of
the input lives in the engine and the loader, whose errors `__main__` prints as one line with exit status 2
(`qwen35_lib.cli_errors`). `--no-check-weights` turns off the loader's check that every weight is finite, where
the loader has one (its `check_finite` keyword).

The plan flags are `qwen35_lib.plan.cli`'s, as every command that takes a plan has them: `--layout` (with
`--routing`, `--fuse-allgather`, `--hierarchical-rs`) other than `single` runs the engine on the `('chip', 'core')`
mesh of `--devices N` devices (default `$QWEN35_DEVICES`, else every device present for the general `tp`,
`tp_kvrep`, `dp_tp2_ep`, `dp_ep`, and 8 for the 8-device names `tp8`, `tp8_kvrep`, `dp4_tp2_ep8`, `dp8_ep8`); on
CPU, simulated devices are made (that many, else 8) when the user set no device count and no backend runs yet.
The plan is checked against the model on that mesh (`ServingPlan.bind`) before any weight is touched; a
checkpoint loads straight into its shards.

With `--json`, stdout holds exactly one JSON document:
    {"requests": [{"prompt_ids": [...], "output_ids": [...], "finish_reason": "length" | "eos", "text"?}, ...],
     "model": ..., "stats": {...}, ...}
with the requests in input order, `output_ids` without the prompt (with the EOS token if one ended it), and
`text` (the decoded output) only when the checkpoint has a `tokenizer.json`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from typing import Any

from qwen35_lib.config import PRESETS
from qwen35_lib.plan import cli as plan_cli

RANDOM_WEIGHTS_SEED = 0
MESH_DEVICES = 8  # the 8-device layouts' ('chip': 4, 'core': 2) mesh (`--devices` / $QWEN35_DEVICES change it)
HUB_EXAMPLE = "Qwen/Qwen3.5-397B-A17B-FP8"
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float8_e4m3fn", "fp8")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate tokens for prompts with the serving engine",
                       description="Run prompts through the serving engine (continuous batching, paged KV cache); "
                                   "greedy unless sampling options are given. Tokens stream to stderr.",
                       epilog="Each new batch shape compiles the engine step once (seconds on CPU); set "
                              "JAX_COMPILATION_CACHE_DIR to reuse compilations across runs.")
    add_model_options(p)
    req = p.add_argument_group("requests (repeatable, in any mix: one request each, in the order given)")
    req.add_argument("--prompt-ids", dest="prompts", action="append", type=lambda s: ("ids", s), metavar='"1 2 3"',
                     help="token ids, separated by spaces or commas")
    req.add_argument("--prompt", dest="prompts", action="append", type=lambda s: ("text", s), metavar="TEXT",
                     help="text, encoded with the checkpoint's tokenizer.json (needs the `tokenizers` package)")
    req.add_argument("--chat", action="store_true",
                     help="--prompt TEXT is a user message: the checkpoint's chat template is applied "
                          "(add_generation_prompt=True)")
    smp = p.add_argument_group("sampling (greedy unless --temperature, --top-k or --top-p is given)")
    smp.add_argument("--max-new-tokens", type=int, default=16, metavar="N", help="default 16")
    smp.add_argument("--temperature", type=float, metavar="T",
                     help="0 = greedy; default 1.0 with --top-k / --top-p, else 0")
    smp.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off (default)")
    smp.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 = off (default)")
    smp.add_argument("--seed", type=int, default=0, metavar="S",
                     help="sampling seed (each token: fold_in(seed, position))")
    smp.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    eng = p.add_argument_group("engine")
    plan_cli.add_arguments(eng)
    eng.add_argument("--max-num-seqs", type=int, default=8, metavar="N", help="sequences running at once (8)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=128, metavar="N", help="new tokens per step (128)")
    eng.add_argument("--page-size", type=int, default=16, metavar="N", help="tokens per KV-cache page (16)")
    eng.add_argument("--max-model-len", type=int, default=1024, metavar="N",
                     help="prompt + output tokens of one request (1024)")
    eng.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                     help="tokens each sequence drafts with the checkpoint's MTP head, verified the next step (0: off)")
    p.add_argument("--json", action="store_true", help="print one JSON document to stdout")
    p.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace of the generation to DIR "
                                                    "(plugins/profile/<run>/*.xplane.pb: TensorBoard, XProf, Perfetto)")
    p.set_defaults(run=run)


def add_model_options(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The "model" options that `generate` and `serve` share: --checkpoint, --model, --dtype, --no-check-weights."""
    src = p.add_argument_group("model")
    src.add_argument("--checkpoint", metavar="DIR|REPO", help="an HF checkpoint directory (config.json + "
                     "*.safetensors; EOS ids from generation_config.json), or a hub id such as "
                     f"{HUB_EXAMPLE} read from the local Hugging Face cache only (fetch it first: hf download REPO)")
    src.add_argument("--model", metavar="PRESET", help=f"without --checkpoint: a preset with random weights (seeded "
                                                       f"{RANDOM_WEIGHTS_SEED}); default qwen3.5-tiny; "
                                                       f"presets: {', '.join(PRESETS)}")
    src.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights and activations (default: the "
                                                                      "checkpoint's or the preset's)")
    src.add_argument("--no-check-weights", dest="check_weights", action="store_false",
                     help="skip the loader's check that every weight is finite (NaN / Inf), done per shard on its "
                          "device")
    src.add_argument("--fp8", choices=("dequantize", "keep"), default="dequantize",
                     help="an FP8 (block-scaled e4m3) checkpoint's expert weights: dequantized to --dtype on load "
                          "(default), or kept in FP8 with their block scales (half the bytes; needs an FP8 checkpoint)")
    src.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                     help="the attention KV cache: auto = the model dtype (default); float8_e4m3fn (alias fp8) = FP8 "
                          "with per-token scales, half the bytes of bfloat16")
    return src


def kv_dtype(args: argparse.Namespace) -> str | None:
    """--kv-cache-dtype as `EngineConfig.kv_dtype` (None: the model dtype)."""
    return {"auto": None, "fp8": "float8_e4m3fn"}.get(args.kv_cache_dtype, args.kv_cache_dtype)


def resolve_checkpoint(value: str | None) -> pathlib.Path | None:
    """--checkpoint as a folder: an existing directory as it is, else a hub id (`org/name`) looked up in the local
    Hugging Face cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub) with `snapshot_download(...,
    local_files_only=True)`: its snapshot folder of `refs/main`; nothing is ever downloaded here."""
    if value is None:
        return None
    path = pathlib.Path(value)
    if path.is_dir():
        return path
    if not is_hub_id(value):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist; pass an HF checkpoint directory, a hub "
                                f"id such as {HUB_EXAMPLE} (from the local cache), or leave --checkpoint out for a "
                                "random preset")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ValueError(f"--checkpoint {value} is a hub id, and reading the Hugging Face cache needs "
                         "huggingface_hub (pip install huggingface_hub); or pass the checkpoint's folder") from None
    import os

    cache = os.environ.get("HF_HUB_CACHE") or None  # None: huggingface_hub's default (HF_HOME/hub)
    try:
        return pathlib.Path(snapshot_download(value, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        raise FileNotFoundError(f"{value} is neither a directory nor in the local Hugging Face cache "
                                f"({cache or constants.HF_HUB_CACHE}); fetch it with `hf download {value}` (nothing "
                                "is downloaded at run time), or pass the checkpoint's folder") from None


def is_hub_id(value: str) -> bool:
    """`org/name` as the hub spells repositories: two parts of letters, digits, '-', '_', '.'."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", value) is not None \
        and ".." not in value


def hub_name(value: str | None) -> str | None:
    """The hub id a --checkpoint was resolved from (the model's name then), or None for a folder or no checkpoint."""
    return value if value is not None and not pathlib.Path(value).is_dir() else None


def checkpoint_name(value: str | None, root: pathlib.Path | None) -> str | None:
    """What the model is served as: the hub id it was given as, else its folder's name."""
    return None if root is None else hub_name(value) or root.resolve().name


def run(args: argparse.Namespace) -> int:
    import jax

    from qwen35_lib.engine import Engine, EngineConfig, SamplingParams

    # 1. Everything that needs no weights first, so bad input fails before a long load.
    if not args.prompts:
        raise ValueError("no prompts: give --prompt-ids \"1 2 3\" or --prompt TEXT (repeatable, one request each)")
    if args.checkpoint and args.model:
        raise ValueError("--checkpoint and --model are exclusive: --model picks a preset with random weights")
    temperature = args.temperature
    if temperature is None:
        temperature = 1.0 if (args.top_k or args.top_p != 1.0) else 0.0
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    ec = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      page_size=args.page_size, max_model_len=args.max_model_len, kv_dtype=kv_dtype(args),
                      speculative_tokens=args.speculative_tokens)
    _ = ec.pages  # checks that the page pool holds one request
    root = resolve_checkpoint(args.checkpoint)
    check_fp8(args.fp8, root)
    tokenizer = _tokenizer(root, needed=any(kind == "text" for kind, _ in args.prompts))
    encode = _chat_encoder(root, args.prompts) if args.chat else (lambda s: tokenizer.encode(s).ids)
    prompts = [_parse_ids(s) if kind == "ids" else encode(s) for kind, s in args.prompts]

    from qwen35_lib.config import from_hf_config, get_config
    from qwen35_lib.engine.requests import validate_request

    shape = from_hf_config(root) if root else get_config(args.model or "qwen3.5-tiny")  # config.json only
    for p in prompts:
        validate_request(shape, ec, p, params)
    plan, mesh = plan_split(args, shape)

    # 2. Weights, engine, generation.
    progress(f"loading {root}" if root else f"random weights for {args.model or 'qwen3.5-tiny'}")
    config, weights = load(root, args.model or "qwen3.5-tiny", args.dtype, plan, mesh, args.check_weights,
                            fp8=args.fp8, name=hub_name(args.checkpoint))
    engine = Engine(config, weights, ec, mesh=mesh, plan=plan,
                    mtp_weights=load_head(root, config, args.dtype, ec.speculative_tokens))
    if mesh is not None:
        progress(f"layout {args.layout} on {mesh.devices.size} {mesh.devices.flat[0].platform} devices "
                  f"{dict(mesh.shape)}: {engine.ec.ranks} data-parallel rank(s) of max_num_seqs={ec.max_num_seqs}")
    progress(f"{config.name}: {len(prompts)} request(s), {'greedy' if temperature == 0 else 'sampling'}, "
              f"EOS {list(config.eos_token_ids) if not args.ignore_eos else 'ignored'}")
    t0 = time.perf_counter()
    streams: dict = {}  # request id -> IncrementalDetokenizer
    with profiled(args.profile):
        results = engine.generate(prompts, params, on_token=lambda rid, tok: _stream(rid, tok, tokenizer, streams))
    wall = time.perf_counter() - t0

    # 3. Report.
    requests = []
    for r in results:
        item: dict[str, Any] = dict(prompt_ids=r.prompt_ids, output_ids=r.output_ids, finish_reason=r.finish_reason)
        if tokenizer is not None:
            item["text"] = tokenizer.decode(r.output_ids)
        requests.append(item)
    out_tokens = sum(len(r.output_ids) for r in results)
    kv_pools = engine.cache.get("kv")  # a stacked pool, or per-layer ones (`model.layer_loop`)
    doc = dict(
        requests=requests, model=config.name, checkpoint=str(root) if root else None, dtype=config.dtype,
        expert_dtype=config.expert_dtype or config.dtype, kv_cache_dtype=None if kv_pools is None
        else str(jax.tree.leaves(kv_pools)[0].dtype),
        layout=args.layout, devices=1 if mesh is None else int(mesh.devices.size), routing=args.routing,
        fuse_allgather=args.fuse_allgather,
        hierarchical_rs=args.hierarchical_rs, eos_token_ids=list(config.eos_token_ids),
        sampling=dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_k=params.top_k,
                      top_p=params.top_p, seed=params.seed, ignore_eos=params.ignore_eos),
        engine=dict(ranks=engine.ec.ranks, max_num_seqs=ec.max_num_seqs,
                    max_num_batched_tokens=ec.max_num_batched_tokens, page_size=ec.page_size,
                    max_model_len=ec.max_model_len, num_pages=ec.pages),
        stats=dict(steps=engine.stats.steps, traces=engine.stats.traces, preemptions=engine.preemptions,
                   mixed_steps=engine.stats.mixed_steps, output_tokens=out_tokens,
                   wall_s=round(wall, 4)),  # compilation included: a benchmark is `python -m qwen35_lib.bench`
    )
    print(json.dumps(doc) if args.json else _summary(doc))
    return 0


def plan_split(args: argparse.Namespace, shape: Any) -> tuple[Any, Any]:
    """The serving plan the flags describe and the mesh it runs on (None for `single`), checked against the model
    `shape` on that mesh (`ServingPlan.bind`: the constraint and the fix) before any weight is loaded."""
    plan = plan_cli.from_args(args)
    if plan.layout == "single":
        return plan.bind(None, shape), None
    mesh = layout_mesh(plan_cli.requested_devices(args), plan.layout)
    return plan.bind(mesh, shape), mesh  # the one check and binding, before any weight is read; handed down


def layout_mesh(devices: int | None = None, layout: str | None = None) -> Any:
    """The ('chip', 'core') mesh over the first `devices` devices; default: every device present for a general
    `layout`, 8 for an 8-device name (or no layout named). On CPU, when no device count was set and no backend is
    running yet, `devices` (else 8) simulated CPU devices are made first (`jax_num_cpu_devices`)."""
    import os

    import jax

    from qwen35_lib.devices import DEFAULT_DEVICES, simulate_cpu_devices
    from qwen35_lib.plan import get_layout, make_mesh

    want = devices or (None if layout and get_layout(layout).devices is None else DEFAULT_DEVICES)
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if not forced and jax.config.jax_num_cpu_devices < 0:
        simulate_cpu_devices(want or DEFAULT_DEVICES)  # only the CPU backend reads it; no-op once a backend runs
    present = jax.devices()
    n = want or len(present)
    if len(present) < n:
        raise ValueError(f"the layout needs {n} devices as ('chip', 'core'); this {present[0].platform} backend has "
                         f"{len(present)}. On CPU, run with XLA_FLAGS=--xla_force_host_platform_device_count={n} (or "
                         f"JAX_NUM_CPU_DEVICES={n}), or use a general layout (it takes every device present, or "
                         "--devices N), or use --layout single")
    return make_mesh(present[:n])


def _parse_ids(s: str) -> list[int]:
    ids = []
    for word in re.split(r"[\s,]+", s.strip()):
        if word:
            try:
                ids.append(int(word))
            except ValueError:
                raise ValueError(f"--prompt-ids {s!r}: {word!r} is not an integer token id") from None
    return ids


def _tokenizer(root: pathlib.Path | None, needed: bool) -> Any:
    """The checkpoint's `tokenizer.json` as a `tokenizers.Tokenizer`, or None when there is none and none is
    needed (it is needed for --prompt)."""
    path = root / "tokenizer.json" if root else None
    if path is None or not path.is_file():
        if needed:
            where = f"{root} has no tokenizer.json" if root else "a random preset has no tokenizer"
            raise ValueError(f"--prompt needs a tokenizer, but {where}; use --prompt-ids, or a --checkpoint "
                             "directory with tokenizer.json")
        return None
    try:
        import tokenizers
    except ImportError:
        if not needed:
            return None
        raise ValueError("--prompt needs the `tokenizers` package (pip install tokenizers); or use --prompt-ids") \
            from None
    return tokenizers.Tokenizer.from_file(str(path))


def load(root: pathlib.Path | None, preset: str, dtype: str | None, plan: Any, mesh: Any,
          check_weights: bool = True, fp8: str = "dequantize", name: str | None = None) -> tuple[Any, dict]:
    """(config, weights): a checkpoint loads straight into its shards under `plan` on `mesh` (its
    weights checked finite unless `check_weights` is False, where the loader checks them; FP8 experts kept with
    `fp8="keep"`; `name` the model's, when given); random weights are drawn for the unsplit preset (the same
    values under every layout) and the engine places them."""
    if root is not None:
        from qwen35_lib.checkpoint import load_hf_checkpoint

        extra = {"fp8": fp8} if fp8 != "dequantize" else {}
        if name is not None:
            extra["name"] = name
        placed = dict(mesh=mesh, layout=plan) if mesh is not None else {}
        return load_hf_checkpoint(root, dtype=dtype, **placed, **extra, check_weights=check_weights)
    from qwen35_lib.config import get_config
    from qwen35_lib.weights import init_weights

    config = get_config(preset, **({"dtype": dtype} if dtype else {}))
    return config, init_weights(config, RANDOM_WEIGHTS_SEED)


def load_head(root: pathlib.Path | None, config: Any, dtype: str | None, k: int) -> dict | None:
    """The MTP head speculative decoding drafts with (`k` > 0): the checkpoint's (a one-line error where it has
    none), or a random one for random weights; None with k = 0. The engine places it as it places the model."""
    if not k:
        return None
    if root is None:
        from qwen35_lib.weights import init_mtp_weights

        return init_mtp_weights(config, RANDOM_WEIGHTS_SEED + 1)
    from qwen35_lib.checkpoint import CheckpointError, load_mtp

    try:
        return load_mtp(root, dtype=dtype)[1]
    except CheckpointError as e:
        if "no multi-token-prediction head" not in str(e):
            raise
        raise ValueError(f"--speculative-tokens {k} drafts with the checkpoint's MTP head, and {root} has none (no "
                         "mtp.* tensors): use a checkpoint that ships one, or leave --speculative-tokens at 0"
                         ) from None


def check_fp8(fp8: str, root: pathlib.Path | None) -> None:
    """--fp8 keep needs a block-scaled FP8 checkpoint (config.json's quantization_config), checked before loading."""
    if fp8 != "keep":
        return
    if root is None:
        raise ValueError("--fp8 keep keeps an FP8 checkpoint's experts in FP8: give an FP8 --checkpoint (e.g. "
                         f"{HUB_EXAMPLE}); random presets are not quantized")
    from qwen35_lib.config import read_json

    if not (root / "config.json").is_file():
        return  # the loader says what is missing
    hf = read_json(root / "config.json", "config.json")
    if not (hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")):
        raise ValueError(f"--fp8 keep: {root} is not an FP8 checkpoint (its config.json has no quantization_config); "
                         "leave --fp8 out, or use the FP8 checkpoint")


def profiled(directory: str | None) -> Any:
    """`jax.profiler.trace(directory)` around a run (the generation; a benchmark), or nothing."""
    import contextlib

    import jax

    if not directory:
        return contextlib.nullcontext()
    progress(f"profiling into {directory}")
    return jax.profiler.trace(directory)


def progress(message: str) -> None:
    """`# message` on stderr, flushed: the CLI's progress lines."""
    print(f"# {message}", file=sys.stderr, flush=True)


def _chat_encoder(root: pathlib.Path | None, prompts: list) -> Any:
    """--chat: each --prompt TEXT as one user message through the checkpoint's chat template."""
    from qwen35_lib.text import load_text

    if root is None or not any(kind == "text" for kind, _ in prompts):
        raise ValueError("--chat applies the checkpoint's chat template to --prompt TEXT: give a --checkpoint "
                         "directory with tokenizer.json and at least one --prompt")
    text = load_text(root)
    return lambda s: text.encode_chat([{"role": "user", "content": s}])


def _stream(rid: int, token: int, tokenizer: Any, streams: dict) -> None:
    """One line per token on stderr: `[req 0] 17`, with the new text when there is a tokenizer (decoded
    incrementally: '' while a multi-byte character is still partial). (The CLI's engine is fresh, so request
    ids are the input indices.)"""
    from qwen35_lib.text import IncrementalDetokenizer

    if tokenizer is not None:
        streams.setdefault(rid, IncrementalDetokenizer(tokenizer))
    piece = f" {streams[rid].push(token)!r}" if tokenizer is not None else ""
    print(f"[req {rid}] {token}{piece}", file=sys.stderr, flush=True)


def _summary(doc: dict) -> str:
    s = doc["sampling"]
    how = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}, top-k {s['top_k']}, " \
                                                 f"top-p {s['top_p']}, seed {s['seed']}"
    lines = [f"{doc['model']} ({doc['checkpoint'] or 'random weights'}, {doc['dtype']}), layout {doc['layout']}, "
             f"{how}, {len(doc['requests'])} request(s)"]
    for i, r in enumerate(doc["requests"]):
        lines.append(f"[{i}] {len(r['prompt_ids'])} prompt tokens -> {len(r['output_ids'])} tokens "
                     f"({r['finish_reason']}): {' '.join(map(str, r['output_ids']))}")
        if "text" in r:
            lines.append(f"    text: {r['text']!r}")
    st = doc["stats"]
    lines.append(f"{st['steps']} steps, {st['traces']} traces, {st['preemptions']} preemptions, "
                 f"{st['output_tokens']} tokens in {st['wall_s']:.2f} s (compilation included)")
    return "\n".join(lines)
