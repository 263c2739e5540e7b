"""The one base class of the errors a user can act on: the CLI prints them as one line and exits 2.

Library code raises a subclass (or ``ValueError`` for a bad value, as Python does) and names the
file at fault, or the option as a caller passes it (``memory_budget=...``, ``resume=True``);
``moekit.cli`` adds the command's name and puts each option in its flag's words (``--memory-budget``).
"""

from __future__ import annotations


class MoekitError(Exception):
    """A failure of the user's input or files (a corrupt checkpoint, a run in the way, a NaN loss)."""
