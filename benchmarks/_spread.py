"""Median and min-max of repeated measurements (runs, seeds or timed blocks): how the benchmarks report a
figure; and the block-alternating timing the benchmarks that compare runs use."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence


def spread(values: Sequence[float], digits: int = 4) -> dict[str, float]:
    """``{"median", "min", "max"}`` of ``values``, rounded to ``digits``."""
    return {key: round(f(values), digits) for key, f in (("median", statistics.median), ("min", min), ("max", max))}


def show(values: Sequence[float], fmt: str = ".4f") -> str:
    """``median (min .. max)``, e.g. ``1.8180 (1.8101 .. 1.8254)``."""
    s = spread(values, digits=12)
    return f"{s['median']:{fmt}} ({s['min']:{fmt}} .. {s['max']:{fmt}})"


def alternate_blocks(steps: Mapping[str, Callable[[], object]], block: int, rounds: int) -> dict[str, list[float]]:
    """Milliseconds per call of each of ``steps``, timed in blocks of ``block`` consecutive calls; the
    sides take turns block by block for ``rounds`` rounds, the order rotating each round. Returns each
    side's ms per call of every block (one figure per round).

    NOTE: why blocks and not single calls: alternating one step at a time makes every step start with
    the other model's weights, activations and allocator blocks in the caches, which taxes the sides
    unequally (the larger model more); running the sides one after the other lets the machine's
    drift (other jobs) land on one side. Blocks of >= 50 calls keep each side's caches warm, and
    taking turns spreads the drift over all sides.
    """
    names = list(steps)
    per_block: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = steps[name]
            started = time.perf_counter()
            for _ in range(block):
                step()
            per_block[name].append((time.perf_counter() - started) / block * 1e3)
    return per_block
