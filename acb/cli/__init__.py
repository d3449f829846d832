"""The ``acb`` command line: ``acb generate`` (:mod:`acb.cli.generate`), ``acb serve``
(:mod:`acb.cli.serve`) and ``acb bench`` (:mod:`acb.cli.bench`), each an ``argparse``
subparser registered by its module; what they share is :mod:`acb.cli.common`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from acb.cli.bench import add_bench_parser, cmd_bench
from acb.cli.common import (
    DEFAULT_OUTPUT,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    STDOUT,
    CliError,
    PromptSpec,
    engine_config,
)
from acb.cli.generate import (
    ResultWriter,
    add_generate_parser,
    cmd_generate,
    load_prompts,
    run_requests,
    synthetic_prompts,
)
from acb.cli.serve import add_serve_parser, cmd_serve

__all__ = [
    "DEFAULT_OUTPUT",
    "EXIT_BROKEN_PIPE",
    "EXIT_INTERRUPTED",
    "STDOUT",
    "CliError",
    "PromptSpec",
    "ResultWriter",
    "build_parser",
    "cmd_bench",
    "cmd_generate",
    "cmd_serve",
    "load_prompts",
    "main",
    "run_requests",
    "synthetic_prompts",
    "engine_config",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="acb",
        description="acb: continuous batching for Hugging Face transformers causal LMs.",
    )
    from acb.version import __version__

    parser.add_argument("--version", action="version", version=f"acb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        try:
            return args.func(args)
        except CliError as exc:  # bad input, not bad flags: the one useful line, no usage; exit status 2
            args._parser.exit(2, f"{args._parser.prog}: error: {exc}\n")
    except KeyboardInterrupt:  # while loading, or a second Ctrl-C during a run: no traceback
        print("acb: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `acb generate -o - | head`: the reader left; stop quietly, as cat does
        # stdout's buffer still holds lines; point it at /dev/null so flushing at exit cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        print("acb: the output pipe was closed; stopped", file=sys.stderr, flush=True)
        return EXIT_BROKEN_PIPE
    return 2  # unreachable


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
