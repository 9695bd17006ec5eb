"""The qwen35_lib command line: `python -m qwen35_lib SUBCOMMAND --help` (or the `qwen35` script).

`info --model NAME [--hardware NAME] [--json]`: parameters, active parameters, bytes, cache sizes, and whether
the model fits. `generate [--checkpoint DIR] --prompt-ids "1 2 3" ... [--layout NAME --routing NAME] [--json]`:
tokens from the serving engine, on one device or split over the 8-device mesh (`qwen35_lib.cli_generate`).
Each subcommand is an argparse subparser registered by one `_add_<name>(subparsers)` of `SUBCOMMANDS` (add a
new one there), whose `run` default is called with the parsed arguments. An expected failure (bad input: see
`qwen35_lib.cli_errors`) ends with one `error: ...` line on stderr and exit status 2; `--debug`, before or after
the subcommand, shows its traceback instead.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from qwen35_lib import budget as budget_lib
from qwen35_lib import cli_errors, cli_generate
from qwen35_lib import hardware as hw
from qwen35_lib.config import DTYPES, EXPERT_DTYPES, PRESETS, Config, from_hf_config, get_config


def _model(name: str, **changes) -> Config:
    """A preset by name, or the `config.json` of a checkpoint directory."""
    if name in PRESETS:
        return get_config(name, **changes)
    path = pathlib.Path(name)
    if path.is_dir() and (path / "config.json").exists():
        return from_hf_config(path, name=path.name, **changes)
    raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or a checkpoint directory)")


def _run_info(args: argparse.Namespace) -> int:
    from qwen35_lib.report import format_report, model_report

    changes = {k: v for k, v in dict(dtype=args.dtype, gdn_state_dtype=args.gdn_state_dtype).items() if v}
    if args.expert_dtype is not None:
        changes["expert_dtype"] = None if args.expert_dtype == "none" else args.expert_dtype
    config = _model(args.model, **changes)
    hardware = hw.get(args.hardware) if args.hardware else None
    if (args.concurrency or args.context_len) and hardware is None:
        raise ValueError("--concurrency and --context-len need --hardware")
    report = model_report(config, hardware, args.concurrency, args.context_len, kv_dtype=args.kv_dtype,
                          spread=args.spread)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="parameters, active parameters, bytes, cache sizes, and whether it fits",
                       description="Sizes of a model, computed from its weight declarations; with --hardware, "
                                   "whether the weights fit and how much cache the rest holds.")
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a checkpoint directory")
    p.add_argument("--hardware", help="a system from data/hardware.json (tpu7x-8, v6e-8, v5p-8, v5e-8, h200, "
                                      "h200-8, cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--dtype", choices=DTYPES, help="weights and activations (default: the preset's)")
    p.add_argument("--expert-dtype", choices=[d for d in EXPERT_DTYPES if d] + ["none"],
                   help="routed-expert weights: block-scaled FP8, or 'none' for --dtype")
    p.add_argument("--kv-dtype", choices=DTYPES, help="KV cache (default: --dtype)")
    p.add_argument("--gdn-state-dtype", choices=DTYPES, help="recurrent GDN state (default: the preset's)")
    p.add_argument("--concurrency", type=int, default=0, help="requests held at once (with --hardware)")
    p.add_argument("--context-len", type=int, default=0, help="tokens each request holds (with --hardware)")
    p.add_argument("--spread", choices=budget_lib.WEIGHT_SPREADS, default="even",
                   help="weights on devices: 'even' (all split) or 'experts_sharded' (the rest replicated)")
    p.set_defaults(run=_run_info)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    cli_generate.add_parser(sub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from qwen35_lib.serve import cli as serve_cli  # fastapi and uvicorn are imported only when it runs

    serve_cli.add_parser(sub)


def _add_recipe(sub: argparse._SubParsersAction) -> None:
    from qwen35_lib import recipe

    recipe.add_parser(sub)


SUBCOMMANDS = (_add_info, _add_generate, _add_serve, _add_recipe)


def build_parser() -> argparse.ArgumentParser:
    parser = cli_errors.ArgumentParser(prog="python -m qwen35_lib", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    cli_errors.add_debug_flag(parser)  # after the subcommands: each gets it too
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli_errors.guard(lambda: args.run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
