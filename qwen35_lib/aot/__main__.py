"""`python -m qwen35_lib.aot sweep [--model NAME] [--stages S,...] [--groups N] [--json PATH] [--xla-option K=V]`:
the ahead-of-time sweep of every stage's engine steps for TPU7x-8 (`qwen35_lib.aot.sweep`); `python -m
qwen35_lib.aot verify [--stage NAME] [--drafts 1,3] [--json PATH]`: the speculative verify step (`aot.verify`).
Errors in the arguments print one `error: ...` line and exit with status 2 (`--debug`: the traceback)."""

from __future__ import annotations

import sys

from qwen35_lib.aot import sweep


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("sweep", "verify"):
        print(f"error: usage: python -m qwen35_lib.aot sweep|verify [options] (got {' '.join(argv) or 'nothing'})",
              file=sys.stderr)
        return 2
    if argv[0] == "verify":  # the speculative verify step (`aot.verify`)
        from qwen35_lib.aot import verify

        return verify.main(argv[1:])
    return sweep.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
