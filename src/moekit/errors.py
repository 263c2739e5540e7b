"""The errors a user can act on: the CLI prints them as one line and exits 2.

Library code raises a subclass of ``MoekitError`` (or ``ValueError`` for a bad value, as Python does)
and names the file at fault. A bad option is an ``OptionError``, which carries the option's name as
the caller passed it (``memory_budget``, ``resume``) and the names of the options its reason mentions,
so each front end says them in its own words: a Python caller reads ``memory_budget='1KB': ...``,
``moekit.cli`` the flag that set it, ``--memory-budget=1KB: ...``.
"""

from __future__ import annotations

from collections.abc import Callable

NO_VALUE = object()  # an option named without a value: "offload: ...", a switch mentioned as such

Namer = Callable[[str, object], str]  # (option, value or NO_VALUE) -> how this front end writes it


class MoekitError(Exception):
    """A failure of the user's input or files (a corrupt checkpoint, a run in the way, a NaN loss)."""


def python_words(option: str, value: object) -> str:
    """An option as a Python caller passes it: ``name``, ``name='text'``, ``name=3``, ``name=/a/path``."""
    if value is NO_VALUE:
        return option
    return f"{option}={value!r}" if isinstance(value, str) else f"{option}={value}"


class OptionError(MoekitError, ValueError):
    """A bad option, named as the caller passed it. ``reason`` may name other options as ``{name}``
    fields, ``mentioned`` giving each one's value (True for a switch): ``OptionError("run_dir",
    "already holds a run; pass {resume}", path, resume=True)``."""

    def __init__(self, option: str, reason: str, value: object = NO_VALUE, **mentioned: object) -> None:
        self.option, self.reason, self.value, self.mentioned = option, reason, value, mentioned
        super().__init__(self.words(python_words))

    def words(self, name: Namer) -> str:
        """The message with the option, and every option its reason mentions, written by ``name``."""
        # NOTE: each mentioned field replaced alone (not str.format): any other brace in the reason, a path's
        # or a problem's, stays as written.
        reason = self.reason
        for option, value in self.mentioned.items():
            reason = reason.replace("{" + option + "}", name(option, value))
        return f"{name(self.option, self.value)}: {reason}"
