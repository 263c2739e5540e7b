"""The ``moekit`` command line."""

from __future__ import annotations

import argparse

from moekit import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moekit",
        description="Train and serve Mixture-of-Experts language models with PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"moekit {__version__}")
    parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
    return 0
