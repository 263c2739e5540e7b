"""``OptionError``: one bad option named in the words of whoever called, Python's or a command's flags.

Reference: the messages written out by hand for each front end; the command's flags are found
through its real parser (``moekit.cli.build_parser``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moekit.cli import build_parser
from moekit.cli.common import flag_words
from moekit.errors import NO_VALUE, MoekitError, OptionError, python_words


def _command(*argv: str):
    return build_parser().parse_args(list(argv)).command_parser


def test_python_words_name_the_argument_as_it_is_passed() -> None:
    assert python_words("resume", NO_VALUE) == "resume"
    assert python_words("memory_budget", "1KB") == "memory_budget='1KB'"
    assert python_words("top_k", -3) == "top_k=-3"
    assert python_words("run_dir", Path("/a/run")) == "run_dir=/a/run"


def test_an_option_error_reads_as_python_and_is_a_value_error() -> None:
    err = OptionError("run_dir", "already holds a run; pass {resume}, or another", Path("r"), resume=True)
    assert str(err) == "run_dir=r: already holds a run; pass resume=True, or another"
    assert isinstance(err, ValueError) and isinstance(err, MoekitError)
    with pytest.raises(ValueError, match=r"^offload: r is a dense model$"):
        raise OptionError("offload", "r is a dense model")
    assert str(OptionError("techniques", "unknown {x} (literal braces)")) == "techniques: unknown {x} (literal braces)"
    with_braces = OptionError("resume", "r/{a} is corrupt (pass {fallback})", True, fallback=True)
    assert str(with_braces) == "resume=True: r/{a} is corrupt (pass fallback=True)"  # a path's braces as written


def test_a_command_names_each_option_by_its_flag() -> None:
    """By the flag whose dest is the option (``--out`` sets upcycle's ``run_dir``), or an alias's
    (``offload`` is ``--memory-budget``); a switch mentioned as set is its flag alone. Config fields
    (``train.lr``) and names no flag of the command sets keep their Python words."""
    train, generate = _command("train"), _command("generate", "run")
    cases = [
        (
            train,
            OptionError("run_dir", "holds a run; pass {resume}", Path("r"), resume=True),
            "--run-dir=r: holds a run; pass --resume",
        ),
        (train, OptionError("resume", "r has no checkpoint", True), "--resume: r has no checkpoint"),
        (
            train,
            OptionError("nnodes", "needs {rdzv_endpoint}", 2, rdzv_endpoint="HOST:PORT"),
            "--nnodes=2: needs --rdzv-endpoint=HOST:PORT",
        ),
        (train, OptionError("preset", "unknown preset 'x'"), "--preset: unknown preset 'x'"),
        (train, OptionError("train.lr", "must be finite", "nan"), "train.lr='nan': must be finite"),
        (train, OptionError("memory_budget", "a flag of generate only", 1), "memory_budget=1: a flag of generate only"),
        (generate, OptionError("offload", "r is a dense model"), "--memory-budget: r is a dense model"),
        (generate, OptionError("top_k", "must be >= 0", -3), "--top-k=-3: must be >= 0"),
        (generate, OptionError("expert_format", "choose from fp", "int8"), "--expert-format=int8: choose from fp"),
        (_command("plot", "run"), OptionError("offload", "r is a dense model"), "offload: r is a dense model"),
        (
            generate,
            OptionError("memory_budget", "smaller than the weights", "10.0 KB"),
            "--memory-budget=10.0 KB: smaller than the weights",
        ),
        (
            _command("upcycle", "d", "--out", "o"),
            OptionError("run_dir", "holds a run", Path("o")),
            "--out=o: holds a run",
        ),
    ]
    for command, err, words in cases:
        assert err.words(flag_words(command)) == words
