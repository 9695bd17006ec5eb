"""Command line: `python -m qwen35_lib.bench NAME [--json PATH] [--repeats N] ...` (NAME from `BENCHMARKS`).

1. Build one argparse subcommand per benchmark from its module's `add_arguments`.
2. Run the chosen benchmark (it prints its table), then write its JSON document to `--json`
   (default `build/bench/NAME.json`) and say where on stderr. `--profile DIR` writes a `jax.profiler` trace of the
   whole run to DIR (the helper `generate --profile` uses).
An expected failure (bad arguments, an unwritable --json path) ends with one `error: ...` line on stderr and exit
status 2 (`qwen35_lib.cli_errors`); `--debug`, before or after NAME, shows its traceback.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from qwen35_lib import cli_errors
from qwen35_lib.bench import BENCHMARKS, default_json_path, load
from qwen35_lib.bench.timing import write_json


def build_parser() -> argparse.ArgumentParser:
    parser = cli_errors.ArgumentParser(prog="python -m qwen35_lib.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name in BENCHMARKS:
        module = load(name)
        p = sub.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION)
        p.add_argument("--json", metavar="PATH", default=str(default_json_path(name)),
                       help="where to write the results (default: %(default)s)")
        p.add_argument("--repeats", type=int, default=3, help="timed calls per candidate; the median is reported")
        p.add_argument("--settle", type=int, default=1, help="untimed calls before each timed one (default: 1)")
        p.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace of the benchmark to DIR "
                                                        "(plugins/profile/<run>/*.xplane.pb: TensorBoard, XProf)")
        module.add_arguments(p)
    cli_errors.add_debug_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = " ".join(["python -m qwen35_lib.bench", *argv])
    return cli_errors.guard(lambda: _run(args), debug=args.debug)


def _run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.settle < 0:
        raise ValueError(f"--repeats {args.repeats} --settle {args.settle}: --repeats must be at least 1 and "
                         "--settle at least 0")
    out = pathlib.Path(args.json)
    if out.is_dir():
        raise ValueError(f"--json {out} is a directory; give the path of the JSON file to write")
    try:  # an unwritable place fails now, not after the benchmark
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"--json {out}: cannot create its folder {out.parent} ({e.strerror or e}); give a writable "
                      "path") from e
    from qwen35_lib.cli_generate import profiled

    with profiled(args.profile):
        doc = load(args.benchmark).run(args)
    path = write_json(args.json, {**doc, "command": args.command_line})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
