"""`python -m qwen35_lib serve`: load a checkpoint (or a random preset) as `generate` does, start the engine loop,
and serve the OpenAI API with uvicorn until interrupted.

The model, layout and engine options are `generate`'s (its loading helpers are reused: `cli_generate.load`,
`plan_split`, `layout_mesh`; the plan flags are `qwen35_lib.plan.cli`'s). The tokenizer is the checkpoint's
tokenizer.json (or `--tokenizer DIR`); without one the server takes token-id prompts only. The socket is bound
before uvicorn starts, so `--port 0` picks a free port, printed on stderr as `# serving MODEL on http://HOST:PORT`.

Start-up (`--warmup background`, the default): /health is ok once the step shapes of one short request are compiled
(two: its prefill and its decode); every other shape (`all_buckets`, plain first, then with logits processing)
compiles on a background thread while the server serves (`loop.EngineLoop`). SIGTERM (or Ctrl-C) stops accepting,
lets the open requests finish for at most --shutdown-timeout seconds, then exits.

Compile cache (`--compile-cache`, on by default, under the user's cache folder): the server process only reads JAX's
persistent compilation cache (entries are written only for compiles of at least 10^9 s, i.e. never), so a restart
loads every program it compiled before instead of compiling it. The entries are written by a child process
(`--fill-compile-cache`, niced, started once /health is ok if the warm-up missed the cache, else once the background
compiles are done if they did), which compiles the same programs again with writing on, the warm-up's first (so a
restart soon after is quick): jaxlib 0.10.2 segfaulted now and then while serializing an
XLA:CPU executable into the cache (the Makefile's note), and a crash there now ends only the child, never the
server (a parent-death signal ends the child with the server).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

from qwen35_lib import cli_generate
from qwen35_lib.cli_errors import port, positive
from qwen35_lib.plan import cli as plan_cli


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine",
                       description="Serve /v1/completions, /v1/chat/completions (streamed or not), /v1/models, "
                                   "/health, /ping, /version, /metrics (Prometheus), /tokenize and /detokenize; one "
                                   "engine loop batches all open requests continuously.",
                       epilog="Needs the serve extra: pip install 'qwen35-playbook[serve]'. /health reports ok "
                              "once the shapes of a short request are compiled; the rest compile in the background "
                              "(--warmup).")
    src = cli_generate.add_model_options(p)
    src.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (and tokenizer_config.json "
                                                        "for chat); default: the checkpoint's")
    src.add_argument("--served-model-name", metavar="NAME", help="the `model` clients send (default: the "
                                                                 "checkpoint folder's name or the preset)")
    eng = p.add_argument_group("engine")
    plan_cli.add_arguments(eng)
    eng.add_argument("--max-num-seqs", type=positive, default=8, metavar="N",
                     help="sequences running at once per rank (8)")
    eng.add_argument("--max-num-batched-tokens", type=positive, default=128, metavar="N",
                     help="new tokens per step per rank (128)")
    eng.add_argument("--page-size", type=positive, default=16, metavar="N", help="tokens per KV-cache page (16)")
    eng.add_argument("--max-model-len", type=positive, default=1024, metavar="N",
                     help="prompt + max_tokens of one request (1024); longer requests get a 400")
    eng.add_argument("--speculative-tokens", type=non_negative_int, default=0, metavar="K",
                     help="tokens each sequence drafts with the checkpoint's MTP head, verified the next step "
                          "(0: off; as generate's: greedy output unchanged, sampling's distribution kept; requests "
                          "with structured output get a 400)")
    eng.add_argument("--warmup", choices=("background", "all", "plain", "none"), default="background",
                     help="background (default): compile the step shapes of one short request before /health "
                          "reports ok, then every other shape this configuration can form (without, then with logits "
                          "processing: penalties, logit_bias, ...) on a background thread while serving; all: every "
                          "shape, both variants, before /health reports ok; plain: every shape without logits "
                          "processing before ok (a processed step compiles on first use); none: each on first use")
    eng.add_argument("--compile-cache", metavar="DIR|off", default=None,
                     help="JAX's persistent compilation cache, read by the server and filled by a child process "
                          "(default: $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/qwen35_lib/jax or "
                          "~/.cache/qwen35_lib/jax; off: none)")
    eng.add_argument("--fill-compile-cache", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument("--port", type=port, default=8000, help="port (default 8000; 0 picks a free one)")
    net.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    net.add_argument("--api-key", metavar="KEY", default=os.environ.get("VLLM_API_KEY"),
                     help="every /v1 request must send `Authorization: Bearer KEY` (401 otherwise), as vLLM's "
                          "--api-key (default: $VLLM_API_KEY; none: open)")
    net.add_argument("--shutdown-timeout", type=non_negative, default=10.0, metavar="S",
                     help="on SIGTERM or Ctrl-C, seconds the open requests may take to finish before the server "
                          "exits anyway (10)")
    net.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                     help="auto (default, as vLLM): a request's missing sampling fields (temperature, top_p, top_k, "
                          "min_p, repetition_penalty) default to the checkpoint's generation_config.json; vllm: "
                          "OpenAI's defaults (temperature 1, no truncation)")
    net.add_argument("--reasoning-parser", choices=("qwen3",), default=None,
                     help="chat answers split into reasoning (`reasoning_content`, `reasoning`: the text before "
                          "</think>) and content, as vLLM's --reasoning-parser qwen3")
    net.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="parse tool calls from chat answers of requests with `tools` (needs --tool-call-parser)")
    net.add_argument("--tool-call-parser", choices=("hermes",), default=None,
                     help="hermes: <tool_call>{\"name\", \"arguments\"}</tool_call> blocks, Qwen's format")
    net.add_argument("--log-stats-interval", type=non_negative, default=10.0, metavar="S",
                     help="log throughput, queue and KV-cache stats every S seconds, as vLLM does (10; 0: never)")
    lim = p.add_argument_group("request bounds (each refusal is a 400 naming the option)")
    lim.add_argument("--max-prompts-per-request", type=positive, default=1024, metavar="N",
                     help="prompts in one /v1/completions request (1024)")
    lim.add_argument("--max-request-bytes", type=positive, default=16 << 20, metavar="N",
                     help="request body size, checked while it is read (16 MiB)")
    lim.add_argument("--max-prompt-chars", type=positive, metavar="N",
                     help="characters of a text prompt (or of a chat's messages), checked before tokenizing "
                          "(default: 2 x max-model-len x the tokenizer's longest token, which no prompt that fits "
                          "can exceed)")
    lim.add_argument("--max-stop-strings", type=positive, default=256, metavar="N",
                     help="`stop` strings in one request (256)")
    lim.add_argument("--max-bad-words", type=positive, default=256, metavar="N",
                     help="`bad_words` in one request (256)")
    lim.add_argument("--max-logit-bias", type=positive, default=1024, metavar="N",
                     help="`logit_bias` entries in one request (1024)")
    lim.add_argument("--max-logprobs", type=non_negative_int, default=20, metavar="N",
                     help="the largest `logprobs`, `top_logprobs` and `prompt_logprobs` (20, as vLLM)")
    lim.add_argument("--max-grammar-bytes", type=positive, default=64 << 10, metavar="N",
                     help="a structured-output constraint (response_format's schema, structured_outputs, guided_*) "
                          "as JSON text (64 KiB)")
    lim.add_argument("--ignore-unknown-fields", action="store_true",
                     help="ignore request fields this server does not know (default: a 400 naming the field, as a "
                          "strict OpenAI server answers); fields it knows but does not support are refused anyway")
    lim.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept a request's own `chat_template` (a template is code the server runs; default: "
                          "refused)")
    p.set_defaults(run=run)


def non_negative(value: str) -> float:
    """An argparse type: a number of seconds >= 0."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return x


def non_negative_int(value: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} must be at least 0")
    return n


def generation_defaults(root: pathlib.Path | None) -> tuple[tuple[str, float], ...]:
    """The sampling defaults of a checkpoint's generation_config.json (vLLM's --generation-config auto): the fields
    of `protocol.DEFAULT_FIELDS` it sets to numbers; () without a checkpoint or a file."""
    from qwen35_lib.serve.protocol import DEFAULT_FIELDS

    path = root / "generation_config.json" if root is not None else None
    if path is None or not path.is_file():
        return ()
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix it or start with --generation-config vllm") from None
    if not isinstance(doc, dict):
        return ()
    return tuple((k, float(doc[k])) for k in DEFAULT_FIELDS
                 if isinstance(doc.get(k), (int, float)) and not isinstance(doc.get(k), bool))


def compile_cache_dir(value: str | None) -> pathlib.Path | None:
    """--compile-cache as a folder (None: off)."""
    if value == "off":
        return None
    if value:
        return pathlib.Path(value).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "qwen35_lib" / "jax"


CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": 0, "/jax/compilation_cache/cache_hits": 0}


def cache_misses() -> int:
    """Programs this process compiled that the persistent cache did not hold: lookups less hits (jax records its
    own `cache_misses` event only when it writes an entry, which a reading server never does)."""
    return CACHE_EVENTS["/jax/compilation_cache/compile_requests_use_cache"] - \
        CACHE_EVENTS["/jax/compilation_cache/cache_hits"]


def use_compile_cache(path: pathlib.Path, write: bool) -> None:
    """JAX's persistent compilation cache in `path`: read always, written only when `write` (the filling child)."""
    import jax

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"--compile-cache {path}: cannot create it ({e.strerror or e}); give a writable folder or "
                      "'off'") from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0 if write else 1e9)

    def count(event: str, **_) -> None:
        if event in CACHE_EVENTS:
            CACHE_EVENTS[event] += 1

    if not write:
        jax.monitoring.register_event_listener(count)


def _child_args(args: argparse.Namespace) -> dict:
    """The options of this server as JSON (the filling child rebuilds the same engine from them)."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}


def spawn_cache_filler(args: argparse.Namespace) -> subprocess.Popen | None:
    """The child that fills the compile cache (niced; ended with this process), when this one missed the cache."""
    if not cache_misses():
        return None
    code = "import sys; from qwen35_lib.serve.cli import fill_from_json; sys.exit(fill_from_json(sys.argv[1]))"
    cli_generate.progress(f"the compile cache missed {cache_misses()} programs: a child process fills it for the "
                          "next start")
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(_child_args(args))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    threading.Thread(target=watch_filler, args=(child,), name="qwen35-cache-filler", daemon=True).start()
    return child


def watch_filler(child: subprocess.Popen) -> None:
    """Wait for the filling child (no zombie left) and say how it ended."""
    start, rc = time.perf_counter(), child.wait()
    if rc == 0:
        cli_generate.progress(f"the compile cache is filled for the next start ({time.perf_counter() - start:.0f} s)")
    elif rc != -signal.SIGTERM:  # SIGTERM: ended with its server
        cli_generate.progress(f"the compile-cache filler exited with {rc}: the next start compiles what it missed "
                              "and tries again")


def fill_from_json(doc: str) -> int:
    """The filling child: lowest priority, SIGTERM when its server dies (Linux), then `run` in fill mode."""
    os.nice(19)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    args = argparse.Namespace(**json.loads(doc))
    args.fill_compile_cache = True
    return run(args)


def longest_token_chars(text) -> int:
    """The most characters one token of the tokenizer stands for (vocabulary entries and added tokens)."""
    vocab = text.tokenizer.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from qwen35_lib.serve.app import make_app
        from qwen35_lib.serve.protocol import Limits
    except ImportError as e:
        raise ValueError(f"serve needs fastapi, uvicorn and prometheus_client ({e.name} is missing): pip install "
                         "'qwen35-playbook[serve]'") from None
    from qwen35_lib.config import from_hf_config, get_config
    from qwen35_lib.engine import Engine, EngineConfig
    from qwen35_lib.serve.loop import EngineLoop
    from qwen35_lib.text import load_text

    # 1. Everything that needs no weights first.
    if args.checkpoint and args.model:
        raise ValueError("--checkpoint and --model are exclusive: --model picks a preset with random weights")
    if getattr(args, "enable_auto_tool_choice", False) != bool(getattr(args, "tool_call_parser", None)):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together (as vLLM): give both or "
                         "neither")
    ec = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      page_size=args.page_size, max_model_len=args.max_model_len,
                      kv_dtype=cli_generate.kv_dtype(args), speculative_tokens=args.speculative_tokens)
    _ = ec.pages  # the page pool holds one request
    root = cli_generate.resolve_checkpoint(args.checkpoint)
    cli_generate.check_fp8(args.fp8, root)
    preset = args.model or "qwen3.5-tiny"
    shape = from_hf_config(root) if root else get_config(preset)
    plan, mesh = cli_generate.plan_split(args, shape)
    tok_dir = pathlib.Path(args.tokenizer) if args.tokenizer else root
    if args.tokenizer and not (tok_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {tok_dir} has no tokenizer.json")
    text = load_text(tok_dir) if tok_dir is not None and (tok_dir / "tokenizer.json").is_file() else None
    name = args.served_model_name or cli_generate.checkpoint_name(args.checkpoint, root) or preset
    cache = compile_cache_dir(args.compile_cache)
    if args.fill_compile_cache:  # the child: compile every program the server runs, writing the cache; no socket
        if cache is None:
            raise ValueError("--fill-compile-cache needs a --compile-cache folder")
        use_compile_cache(cache, write=True)
        config, weights = cli_generate.load(root, preset, args.dtype, plan, mesh, args.check_weights, fp8=args.fp8,
                                             name=cli_generate.hub_name(args.checkpoint))
        engine = Engine(config, weights, ec, mesh=mesh, plan=plan,
                        mtp_weights=cli_generate.load_head(root, config, args.dtype, ec.speculative_tokens))
        first, rest = warmup_shapes(engine, "background")  # the shapes /health waits for first
        for d, t, processing in first + rest:
            engine.precompile(buckets=[(d, t)], processing=processing)
        return 0
    sock = bind_socket(args.host, args.port)
    if cache is not None:
        use_compile_cache(cache, write=False)

    # 2. Weights, engine, loop, server.
    cli_generate.progress(f"loading {root}" if root else f"random weights for {preset}")
    config, weights = cli_generate.load(root, preset, args.dtype, plan, mesh, args.check_weights, fp8=args.fp8,
                                         name=cli_generate.hub_name(args.checkpoint))
    engine = Engine(config, weights, ec, mesh=mesh, plan=plan,
                    mtp_weights=cli_generate.load_head(root, config, args.dtype, ec.speculative_tokens))
    _log_to_stderr()
    warmup, background = warmup_shapes(engine, args.warmup)
    filler: list = []

    def fill() -> None:  # once: after the warm-up if it missed the cache, else after the background compiles
        if cache is not None and not any(filler):
            filler[:] = [spawn_cache_filler(args)]

    loop = EngineLoop(engine, warmup=warmup, background=background, log_interval_s=args.log_stats_interval,
                      on_ready=fill, on_compiled=fill).start()
    chars = args.max_prompt_chars or 2 * ec.max_model_len * (longest_token_chars(text) if text else 1)
    limits = Limits(max_model_len=ec.max_model_len, max_prompts_per_request=args.max_prompts_per_request,
                    max_prompt_chars=chars, max_request_bytes=args.max_request_bytes,
                    ignore_unknown_fields=args.ignore_unknown_fields,
                    trust_request_chat_template=args.trust_request_chat_template,
                    max_stop_strings=args.max_stop_strings, max_bad_words=args.max_bad_words,
                    max_logit_bias=args.max_logit_bias, max_logprobs=args.max_logprobs,
                    max_grammar_bytes=args.max_grammar_bytes,
                    eos_token_ids=tuple(config.eos_token_ids),
                    defaults=generation_defaults(root) if args.generation_config == "auto" else (),
                    reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)
    host, port = sock.getsockname()[:2]
    cli_generate.progress(f"serving {name} on http://{host}:{port} (layout {args.layout}, {engine.ec.ranks} "
                           f"rank(s) of max_num_seqs={ec.max_num_seqs}; "
                           f"{'tokenizer ' + str(tok_dir) if text else 'no tokenizer: token-id prompts only'}; "
                           f"{len(warmup)} step shapes to compile before /health is ok, {len(background)} in the "
                           "background after)")
    server = uvicorn.Server(uvicorn.Config(make_app(loop, name, text, limits, api_key=args.api_key),
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=max(args.shutdown_timeout, 0.01)))
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
        sock.close()
        for child in filler:
            if child is not None and child.poll() is None:
                child.terminate()
    return 0


def warmup_shapes(engine, mode: str) -> tuple[list, list]:
    """(shapes compiled before /health is ok, shapes compiled in the background after) as (D, T, processing)."""
    every = [(d, t, p) for p in (False, True) for d, t in all_buckets(engine)]  # with drafts too (97cb0ec)
    if mode == "all":
        return every, []
    if mode == "plain":
        return [s for s in every if not s[2]], []
    if mode == "none":
        return [], []
    first = [(d, t, False) for d, t in engine.workload_buckets([1], 2)]  # one short request: its prefill, its decode
    return first, [s for s in every if s not in first]


def all_buckets(engine) -> list[tuple[int, int]]:
    """Every (D, T) step shape the engine can form: each decode bucket with each prefill bucket."""
    return [engine.step_shape(d, p) for d in engine.decode_buckets for p in engine.prefill_buckets]


def _log_to_stderr() -> None:
    import logging

    log = logging.getLogger("qwen35_lib.serve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("# %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        why = getattr(e, "strerror", None) or e
        raise ValueError(f"cannot listen on {host}:{port} ({why}); pick another --port (0: any free one)") from None
    return sock

