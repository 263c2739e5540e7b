"""The ``moekit`` command line: parsing and dispatch only, one module per command.

A new command is a module here with ``add_parser(commands)`` (which sets ``run``) and
``run(args) -> exit code``, listed in ``COMMANDS``.
"""

from __future__ import annotations

import os
import sys

from moekit import __version__
from moekit.cli import convert, export, generate, plan, plot, serve, train, upcycle
from moekit.cli.common import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, Parser, flag_words

COMMANDS = (train, generate, serve, plot, plan, convert, export, upcycle)  # in --help's order


def build_parser() -> Parser:
    parser = Parser(
        prog="moekit",
        description="Train and serve Mixture-of-Experts language models with PyTorch.",
        epilog="Run 'moekit COMMAND --help' for a command's options. Start with: moekit train",
    )
    parser.add_argument("--version", action="version", version=f"moekit {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(commands)
    for sub in commands.choices.values():
        sub.set_defaults(command_parser=sub)  # its flags name the options library errors name
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    for name, value in getattr(args, "environment", {}).items():  # before torch loads: OpenMP reads them once
        os.environ.setdefault(name, value)
    from moekit.errors import MoekitError, OptionError
    from moekit.parallel.failures import RankFailure, exit_after_rank_failure

    rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
    try:
        return args.run(args)
    except RankFailure as err:
        print(f"moekit {args.command}{rank}: error: {err}", file=sys.stderr)
        exit_after_rank_failure(EXIT_FAILURE)
    except (MoekitError, ValueError, FileNotFoundError) as err:
        words = err.words(flag_words(args.command_parser)) if isinstance(err, OptionError) else str(err)
        print(f"moekit {args.command}{rank}: error: {words}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"moekit {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
