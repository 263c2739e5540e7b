"""Which code printed a benchmark's figures: the commit of the checkout the benchmarks run from."""

from __future__ import annotations

import subprocess
from pathlib import Path


def source_commit(tree: Path | None = None) -> str | None:
    """``git describe --always --dirty`` of this checkout, or of the checkout holding ``tree``
    (``...-dirty``: uncommitted changes); None outside git."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=tree or Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None
