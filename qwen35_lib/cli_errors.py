"""How every command line of the package ends a failure: one `error: ...` line on stderr and exit status 2.

1. `ArgumentParser`: argparse's parser whose usage errors end the same way (usage, then `error: PROG: ...`);
   subcommand parsers made from it inherit it.
2. `add_debug_flag(parser)`: `--debug` on the parser and on each subcommand already registered (so it may go
   before or after the subcommand's name): with it, an error raises and shows its traceback.
3. `guard(fn, debug)`: calls `fn()`; an expected failure -- bad input -- becomes one line and status 2:
   - `ValueError` (`json.JSONDecodeError` included) and `OSError` (`FileNotFoundError`, permissions...): their
     message, which names the input;
   - `KeyError`, `IndexError`, `TypeError`, `AttributeError`: input of an unexpected structure (a config.json
     that is a list, an index without `weight_map`, a header entry of the wrong type); their message names no
     input, so the line adds where it was raised;
   - Ctrl-C: `interrupted`, status 130; stdout closed by its reader (`| head`): nothing more, status 1.
   Anything else (an `AssertionError`, a `ZeroDivisionError`, jax's runtime errors) is a bug, or a check still
   missing, and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import traceback
from typing import Callable, NoReturn

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
INPUT_ERRORS = (ValueError, OSError)  # the message names the input
STRUCTURE_ERRORS = (KeyError, IndexError, TypeError, AttributeError)  # the message names a key, a type, an index
DEBUG_HELP = "on an error, show the Python traceback instead of one line"
_PACKAGE = pathlib.Path(__file__).resolve().parent


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, ending a usage error as every error here ends: usage, then `error: PROG: MESSAGE`."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"error: {self.prog}: {message}\n")


def positive(value: str) -> int:
    """An argparse type: an integer >= 1 (a size, a length, a concurrency), refused in one line otherwise."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1")
    return n


def port(value: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0: the system picks a free one), refused in one line otherwise."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port: give 0..65535 (0 picks a free one)")
    return n


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """`--debug` on `parser` and on each of its subcommand parsers (call it after registering them)."""
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if id(sub) not in seen:  # aliases share a parser
                    seen.add(id(sub))
                    # SUPPRESS: a subcommand without --debug keeps the value given before its name
                    sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


def guard(fn: Callable[[], int], debug: bool = False) -> int:
    """`fn()`'s exit status; an expected failure prints `error: ...` (see the module doc) unless `debug`."""
    try:
        return fn()
    except BrokenPipeError:  # stdout closed early (`| head`): not an error of the input
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except INPUT_ERRORS + STRUCTURE_ERRORS as e:
        if debug:
            raise
        print(f"error: {describe(e)}", file=sys.stderr)
        return EXIT_ERROR


def describe(e: BaseException) -> str:
    """One line for an expected failure."""
    if isinstance(e, json.JSONDecodeError):
        text = f"invalid JSON: {e}"
    elif isinstance(e, INPUT_ERRORS):
        text = str(e) or type(e).__name__
    else:
        what = f"missing entry {e.args[0]!r}" if isinstance(e, KeyError) and e.args else f"{type(e).__name__}: {e}"
        text = f"the input has an unexpected structure ({what}, raised at {_where(e)}); check the file it came " \
               "from, or rerun with --debug for the traceback"
    return re.sub(r"\s*\n\s*", " ", text.strip())


def _where(e: BaseException) -> str:
    """`file:line` of the innermost frame of `e`'s traceback, relative to the package when it is inside it."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "an unknown place"
    path = pathlib.Path(frames[-1].filename)
    try:
        path = path.resolve().relative_to(_PACKAGE.parent)
    except ValueError:
        path = pathlib.Path(path.name)
    return f"{path}:{frames[-1].lineno}"


__all__ = ["ArgumentParser", "EXIT_ERROR", "add_debug_flag", "describe", "guard"]
