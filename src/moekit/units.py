"""Byte sizes as people write them (``512MB``, ``1.5GiB``) and as reports print them."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, name: str) -> int:
    """``512MB``, ``1.5GiB``, ``1000000`` -> bytes; a ValueError names ``name`` (the option given ``text``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={text!r}: give a size such as 512MB, 2GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError
