"""A library error names its options structurally; each command names them by the flags it defines
(``cli.common.flag_words``, read from the command's own argparse parser)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moekit.cli import build_parser
from moekit.cli.common import flag_words
from moekit.errors import NO_VALUE, MoekitError, OptionError


def _command(name: str) -> argparse.ArgumentParser:
    """The parser of command ``name``, as ``moekit NAME`` parses its flags."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize(
    ("command", "option", "value", "flag"),
    [
        ("train", "resume", True, "--resume"),  # a switch set
        ("train", "resume", NO_VALUE, "--resume"),
        ("train", "run_dir", Path("r"), "--run-dir=r"),
        ("train", "nnodes", 2, "--nnodes=2"),
        ("train", "rdzv_endpoint", "HOST:PORT", "--rdzv-endpoint=HOST:PORT"),  # no quotes: as typed
        ("train", "preset", NO_VALUE, "--preset"),
        ("train", "train.lr", float("nan"), "train.lr=nan"),  # a config field: its value may be from a file
        ("train", "memory_budget", "1KB", "memory_budget='1KB'"),  # no flag of train: Python's words
        ("generate", "offload", NO_VALUE, "--memory-budget"),  # load_run(offload=...): an alias
        ("generate", "memory_budget", "10.0 KB", "--memory-budget=10.0 KB"),
        ("generate", "top_k", -3, "--top-k=-3"),
        ("generate", "expert_format", "int8", "--expert-format=int8"),
        ("convert", "run_dir", Path("o"), "--out=o"),  # a flag of another name sets the dest
        ("plan", "model", NO_VALUE, "--model"),
        ("plot", "offload", NO_VALUE, "offload"),  # the alias is generate's and serve's, not plot's
    ],
)
def test_each_option_is_named_by_the_flag_that_sets_it(command: str, option: str, value: object, flag: str) -> None:
    assert flag_words(_command(command))(option, value) == flag


def test_an_option_error_reads_in_the_commands_words() -> None:
    train = flag_words(_command("train"))
    held = OptionError("run_dir", "already holds a run; pass {resume}, or choose another", Path("r"), resume=True)
    assert held.words(train) == "--run-dir=r: already holds a run; pass --resume, or choose another"
    nodes = OptionError("nnodes", "needs {rdzv_endpoint}", 2, rdzv_endpoint="HOST:PORT")
    assert nodes.words(train) == "--nnodes=2: needs --rdzv-endpoint=HOST:PORT"
    assert str(nodes) == "nnodes=2: needs rdzv_endpoint='HOST:PORT'"
    corrupt = MoekitError("step_4 is corrupt (pass {fallback} to resume from the one before)", fallback=True)
    assert corrupt.words(train) == "step_4 is corrupt (pass --fallback to resume from the one before)"
    dense = OptionError("offload", "r is a dense model; it has no experts to offload")
    assert (
        dense.words(flag_words(_command("generate")))
        == "--memory-budget: r is a dense model; it has no experts to offload"
    )
