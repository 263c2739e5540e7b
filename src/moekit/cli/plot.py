"""``moekit plot``: PNG plots of a run's metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli.common import check_out_dir


def add_parser(commands) -> None:
    plot = commands.add_parser(
        "plot", help="write PNG plots of a run's metrics", description="Write PNG plots of a run."
    )
    plot.set_defaults(run=run)
    plot.add_argument("run_dir", type=Path, help="a run directory written by moekit train")
    plot.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/plots)")


def run(args: argparse.Namespace) -> int:
    from moekit.train.plots import plot_run

    check_out_dir(args.out)
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0
