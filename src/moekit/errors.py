"""The one base class of the errors a user can act on: the CLI prints them as one line and exits 2.

Library code raises a subclass (or ``ValueError`` for a bad value, as Python does) and names the
option or file at fault; ``moekit.cli`` adds nothing but the command's name.
"""

from __future__ import annotations


class MoekitError(Exception):
    """A failure of the user's input or files (a corrupt checkpoint, a run in the way, a NaN loss)."""
