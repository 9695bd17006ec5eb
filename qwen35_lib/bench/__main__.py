"""Command line: `python -m qwen35_lib.bench NAME [--json PATH] [--repeats N] ...` (NAME from `BENCHMARKS`).

1. Build one argparse subcommand per benchmark from its module's `add_arguments`.
2. Run the chosen benchmark (it prints its table), then write its JSON document to `--json`
   (default `build/bench/NAME.json`) and say where on stderr. `--profile DIR` writes a `jax.profiler` trace of the
   whole run to DIR (the helper `generate --profile` uses).
An expected failure (bad arguments, an unwritable --json path) ends with one `error: ...` line on stderr and exit
status 2 (`qwen35_lib.cli_errors`); `--debug`, before or after NAME, shows its traceback.

Run as a command on Linux (glibc 2.35 or later, transparent huge pages in `madvise` mode), the process re-executes
itself once with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (`huge_pages_env`): XLA:CPU allocates each execution's
buffers afresh and touches them page by page, so with 4 KiB pages a qwen3.5-mini prefill of 2,048 tokens took
~188,000 page faults a call (1,052 with huge pages; forward CPU time 3,561 -> 3,253 ms, 4x256 1,317 -> 1,135 ms,
interleaved processes, load 8-11 on 2 cores). Both sides of a comparison run in the one process, so both get it;
`QWEN35_HUGEPAGES=0` turns it off, and a `GLIBC_TUNABLES` that already names `glibc.malloc.hugetlb` is kept.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys

from qwen35_lib import cli_errors
from qwen35_lib.bench import BENCHMARKS, default_json_path, isa, load
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
        p.add_argument("--native-isa", metavar="LIST", help=isa.HELP)
        module.add_arguments(p)
    cli_errors.add_debug_flag(parser)
    return parser


HUGE_PAGES = "glibc.malloc.hugetlb=1"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_env(environ: dict[str, str], libc: tuple[str, str], thp: str | None) -> dict[str, str] | None:
    """The environment to re-execute with so that glibc's malloc asks for transparent huge pages (madvise), or
    None where it is not needed or not possible: turned off (`QWEN35_HUGEPAGES=0`), already set, not glibc 2.35+
    (`platform.libc_ver()`), or the kernel's THP setting `thp` (the text of THP_SETTING) not `[madvise]`."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if environ.get("QWEN35_HUGEPAGES", "1") == "0" or "glibc.malloc.hugetlb" in tunables:
        return None
    name, version = libc
    try:
        new_enough = name == "glibc" and tuple(int(p) for p in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        new_enough = False
    if not new_enough or thp is None or "[madvise]" not in thp:
        return None
    return dict(environ, GLIBC_TUNABLES=":".join(t for t in (tunables, HUGE_PAGES) if t))


def _reexec_with_huge_pages() -> None:
    """Replace this process by the same command with `huge_pages_env`'s environment (when it gives one)."""
    try:
        thp = pathlib.Path(THP_SETTING).read_text()
    except OSError:
        thp = None
    env = huge_pages_env(dict(os.environ), platform.libc_ver(), thp)
    if env is not None:
        print(f"bench: re-running with GLIBC_TUNABLES={env['GLIBC_TUNABLES']} (XLA:CPU buffers on transparent "
              "huge pages; QWEN35_HUGEPAGES=0 turns this off)", file=sys.stderr, flush=True)
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = " ".join(["python -m qwen35_lib.bench", *argv])
    args.argv = list(argv)
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

    if args.native_isa:  # once per native ISA variant, each in its own process, then side by side
        doc = isa.run_variants(args.benchmark, args.argv, args.json, isa.variants(args.native_isa))
    else:
        with profiled(args.profile):
            doc = load(args.benchmark).run(args)
    status = int(doc.pop("exit_status", 0)) if isinstance(doc, dict) else 0  # e.g. serve: requests failed
    path = write_json(args.json, {**doc, "command": args.command_line})
    print(f"wrote {path}", file=sys.stderr)
    return status


if __name__ == "__main__":
    _reexec_with_huge_pages()
    sys.exit(main())
