"""Errors name options structurally: the option and the options a reason mentions are written by the
front end (here in Python's words, as a library caller passes them), never found in the message text."""

from __future__ import annotations

from pathlib import Path

import pytest

from moekit.errors import NO_VALUE, MoekitError, OptionError, python_words


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (NO_VALUE, "offload"),
        ("1KB", "offload='1KB'"),
        (3, "offload=3"),
        (True, "offload=True"),
        (Path("/runs/a"), "offload=/runs/a"),  # a path prints as plain text
    ],
)
def test_python_words_write_an_option_as_a_caller_passes_it(value: object, words: str) -> None:
    assert python_words("offload", value) == words


def test_an_option_error_names_its_option_and_the_options_its_reason_mentions() -> None:
    err = OptionError("run_dir", "already holds a run; pass {resume}, or another", Path("r"), resume=True)
    assert str(err) == "run_dir=r: already holds a run; pass resume=True, or another"
    assert err.words(lambda option, value: f"<{option}>") == "<run_dir>: already holds a run; pass <resume>, or another"
    assert err.option == "run_dir" and err.value == Path("r") and err.mentioned == {"resume": True}
    assert isinstance(err, ValueError) and isinstance(err, MoekitError)  # caught as either, as before


def test_braces_other_than_mentioned_options_are_left_as_they_are() -> None:
    """A path or value put in the reason needs no escaping: only ``{name}`` of a mentioned option is read."""
    mentioned = OptionError("init", "{x}/run {0} is sharded; pass {fallback}", "{x}/run", fallback=True)
    assert str(mentioned) == "init='{x}/run': {x}/run {0} is sharded; pass fallback=True"
    assert str(OptionError("preset", "unknown preset '{a}'")) == "preset: unknown preset '{a}'"


def test_any_moekit_error_may_mention_an_option() -> None:
    """A checkpoint error is not a bad option, but its advice may name one (``pass fallback=True``)."""
    err = MoekitError("{dir} names step_4, which is missing (pass {fallback})", fallback=True)
    assert str(err) == "{dir} names step_4, which is missing (pass fallback=True)"
    assert err.words(lambda option, value: "--" + option) == "{dir} names step_4, which is missing (pass --fallback)"
    assert str(MoekitError("a run in the way")) == MoekitError("a run in the way").words(python_words)
