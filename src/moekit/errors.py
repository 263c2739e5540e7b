"""The errors a user can act on: the CLI prints them as one line and exits 2.

Library code raises a subclass of ``MoekitError`` (or ``ValueError`` for a bad value, as Python
does) naming the file at fault. A bad option is an ``OptionError``: it carries the option's name as
the caller passed it (``memory_budget``, ``resume``) and its value, so each front end says it in its
own words: a Python caller reads ``memory_budget='1KB': ...``, ``moekit.cli`` the flag that set it,
``--memory-budget=1KB: ...`` (``words``). Any of these errors may also mention other options in its
reason as ``{name}`` fields, each with its value (``pass {resume}``, ``resume=True``): Python callers
read ``pass resume=True``, the command line ``pass --resume``. No front end parses message text.
"""

from __future__ import annotations

from collections.abc import Callable

NO_VALUE = object()  # the value of an option named without one ("offload: ...", a switch named as such)

Namer = Callable[[str, object], str]  # (option, its value or NO_VALUE) -> how a front end writes it


def python_words(option: str, value: object) -> str:
    """An option as a Python caller passes it: ``name``, ``name='text'``, ``name=3``, ``name=/a/path``."""
    if value is NO_VALUE:
        return option
    return f"{option}={value!r}" if isinstance(value, str) else f"{option}={value}"


class MoekitError(Exception):
    """A failure of the user's input or files (a corrupt checkpoint, a run in the way, a NaN loss).

    ``reason`` may name options as ``{name}`` fields, ``mentioned`` giving each one's value (True
    for a switch); no other braces are read, so a path or a value in the reason needs no escaping."""

    def __init__(self, reason: str = "", **mentioned: object) -> None:
        self.reason, self.mentioned = reason, mentioned
        super().__init__(self.words(python_words))

    def words(self, name: Namer) -> str:
        """The message with every option it mentions named by ``name(option, value)``."""
        text = self.reason
        for option, value in self.mentioned.items():
            text = text.replace(f"{{{option}}}", name(option, value))
        return text


class OptionError(MoekitError, ValueError):
    """A bad option, named as the caller passed it (``memory_budget``, ``resume``), so each front end says
    it in its own words: Python callers read ``memory_budget='1KB': ...``, the command line
    ``--memory-budget=1KB: ...``. ``OptionError("run_dir", "holds a run; pass {resume}", path, resume=True)``."""

    def __init__(self, option: str, reason: str, value: object = NO_VALUE, **mentioned: object) -> None:
        self.option, self.value = option, value
        super().__init__(reason, **mentioned)

    def words(self, name: Namer) -> str:
        """The message with the option and every option its reason mentions named by ``name(option, value)``."""
        return f"{name(self.option, self.value)}: {super().words(name)}"
