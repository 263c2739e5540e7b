"""Median and min-max of repeated measurements (runs or seeds): how the benchmarks report a figure."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def spread(values: Sequence[float], digits: int = 4) -> dict[str, float]:
    """``{"median", "min", "max"}`` of ``values``, rounded to ``digits``."""
    return {key: round(f(values), digits) for key, f in (("median", statistics.median), ("min", min), ("max", max))}


def show(values: Sequence[float], fmt: str = ".4f") -> str:
    """``median (min .. max)``, e.g. ``1.8180 (1.8101 .. 1.8254)``."""
    s = spread(values, digits=12)
    return f"{s['median']:{fmt}} ({s['min']:{fmt}} .. {s['max']:{fmt}})"
