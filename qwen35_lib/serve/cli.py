"""`python -m qwen35_lib serve`: load a checkpoint (or a random preset) as `generate` does, start the engine loop,
and serve the OpenAI API with uvicorn until interrupted.

The model, layout and engine options are `generate`'s (its loading helpers are reused: `cli_generate._load`,
`check_split`, `layout_mesh`). The tokenizer is the checkpoint's tokenizer.json (or `--tokenizer DIR`); without
one the server takes token-id prompts only. The socket is bound before uvicorn starts, so `--port 0` picks a free
port, printed on stderr as `# serving MODEL on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import pathlib
import socket

from qwen35_lib import cli_generate


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine",
                       description="Serve /v1/completions, /v1/chat/completions (streamed or not), /v1/models and "
                                   "/health; one engine loop batches all open requests continuously.",
                       epilog="Needs the serve extra: pip install 'qwen35-playbook[serve]'. Each new batch shape "
                              "compiles the engine step once (seconds on CPU).")
    src = cli_generate.add_model_options(p)
    src.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (and tokenizer_config.json "
                                                        "for chat); default: the checkpoint's")
    src.add_argument("--served-model-name", metavar="NAME", help="the `model` clients send (default: the "
                                                                 "checkpoint folder's name or the preset)")
    eng = p.add_argument_group("engine")
    cli_generate.add_layout_options(eng)
    eng.add_argument("--max-num-seqs", type=int, default=8, metavar="N", help="sequences running at once per rank (8)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=128, metavar="N",
                     help="new tokens per step per rank (128)")
    eng.add_argument("--page-size", type=int, default=16, metavar="N", help="tokens per KV-cache page (16)")
    eng.add_argument("--max-model-len", type=int, default=1024, metavar="N", help="prompt + output tokens (1024)")
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    net.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from qwen35_lib.serve.app import make_app
    except ImportError as e:
        raise ValueError(f"serve needs fastapi and uvicorn ({e.name} is missing): pip install "
                         "'qwen35-playbook[serve]'") from None
    from qwen35_lib.config import from_hf_config, get_config
    from qwen35_lib.engine import Engine, EngineConfig
    from qwen35_lib.serve.loop import EngineLoop
    from qwen35_lib.text import load_text

    # 1. Everything that needs no weights first.
    if args.checkpoint and args.model:
        raise ValueError("--checkpoint and --model are exclusive: --model picks a preset with random weights")
    ec = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      page_size=args.page_size, max_model_len=args.max_model_len,
                      kv_dtype=cli_generate.kv_dtype(args))
    _ = ec.pages  # the page pool holds one request
    root = cli_generate.resolve_checkpoint(args.checkpoint)
    cli_generate.check_fp8(args.fp8, root)
    preset = args.model or "qwen3.5-tiny"
    shape = from_hf_config(root) if root else get_config(preset)
    split = cli_generate._split_options(args)
    cli_generate.check_split(shape.replace(**split), args.devices)
    tok_dir = pathlib.Path(args.tokenizer) if args.tokenizer else root
    if args.tokenizer and not (tok_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {tok_dir} has no tokenizer.json")
    text = load_text(tok_dir) if tok_dir is not None and (tok_dir / "tokenizer.json").is_file() else None
    name = args.served_model_name or cli_generate.checkpoint_name(args.checkpoint, root) or preset
    sock = _bind(args.host, args.port)
    mesh = cli_generate.layout_mesh(args.devices) if args.layout != "single" else None

    # 2. Weights, engine, loop, server.
    cli_generate._progress(f"loading {root}" if root else f"random weights for {preset}")
    config, weights = cli_generate._load(root, preset, args.dtype, split, mesh, args.check_weights, fp8=args.fp8,
                                         name=cli_generate.hub_name(args.checkpoint))
    engine = Engine(config, weights, ec, mesh=mesh)
    loop = EngineLoop(engine).start()
    host, port = sock.getsockname()[:2]
    cli_generate._progress(f"serving {name} on http://{host}:{port} (layout {args.layout}, {engine.ec.ranks} "
                           f"rank(s) of max_num_seqs={ec.max_num_seqs}; "
                           f"{'tokenizer ' + str(tok_dir) if text else 'no tokenizer: token-id prompts only'})")
    server = uvicorn.Server(uvicorn.Config(make_app(loop, name, text), log_level=args.log_level))
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
        sock.close()
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port (0: any free one)") \
            from None
    return sock

