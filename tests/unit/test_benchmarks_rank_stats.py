"""The rank statistics benchmarks/planner_calibration.py reports, against values worked by hand."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_calibration.py"
_SPEC = importlib.util.spec_from_file_location("planner_calibration", _PATH)
calibration = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(calibration)
sys.path.remove(str(_PATH.parent))  # the script puts its folder first on the path for its own imports


def test_spearman_and_kendall_without_ties() -> None:
    """One swapped pair of four: Spearman 1 - 6 * 2 / (4 * 15) = 0.8, Kendall (5 - 1) / 6."""
    xs, ys = [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]
    assert calibration.spearman(xs, ys) == pytest.approx(0.8)
    assert calibration.kendall_tau_b(xs, ys) == pytest.approx(4 / 6)


def test_spearman_and_kendall_with_a_tie() -> None:
    """xs ties its first two: ranks (0.5, 0.5, 2, 3) against (0, 1, 2, 3) correlate 4.5 / sqrt(4.5 * 5);
    tau-b counts 5 concordant pairs of 6, over sqrt((6 - 1) * 6)."""
    xs, ys = [1.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]
    assert calibration.spearman(xs, ys) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert calibration.kendall_tau_b(xs, ys) == pytest.approx(5 / math.sqrt(30))


def _repeat(measured: list[float], predicted: list[float]) -> dict:
    return {
        "rows": [
            {"layout": name, "measured_s": m, "predicted_s": p}
            for name, m, p in zip("abcd", measured, predicted, strict=True)
        ]
    }


def test_each_repeat_is_scored_against_the_other_repeats_only() -> None:
    """Repeat 0 against the median (here the mean) of repeats 1 and 2, (3, 3.5, 1, 2.5): its measurements
    (1, 2, 3, 4) score -3 / 5 = -0.6 (with its own in the median, (2, 3, 1, 3), they would score +0.21);
    predictions ordered as that reference score 1."""
    repeats = [
        _repeat([1.0, 2.0, 3.0, 4.0], [3.0, 3.5, 1.0, 2.5]),
        _repeat([4.0, 3.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0]),
        _repeat([2.0, 4.0, 1.0, 3.0], [1.0, 2.0, 3.0, 4.0]),
    ]
    assert calibration.against_the_others(repeats, "measured_s")[0] == pytest.approx(-0.6)
    assert calibration.against_the_others(repeats, "predicted_s")[0] == pytest.approx(1.0)
    # each pair of repeats, by hand from their ranks: (0, 1) -4 / 5, (0, 2) 0, (1, 2) 2 / 5
    assert calibration.ceiling(repeats) == pytest.approx([-0.8, 0.0, 0.4])


def test_the_others_are_taken_by_their_median() -> None:
    """Four repeats: repeat 0's reference is the median of three, (2, 3, 1, 3), against which (1, 2, 3, 4)
    scores 1 / sqrt(22.5); their mean would score 0.4, a median with repeat 0's own 0.8."""
    predicted = [1.0, 2.0, 3.0, 4.0]
    repeats = [
        _repeat([1.0, 2.0, 3.0, 4.0], predicted),
        _repeat([4.0, 3.0, 1.0, 2.0], predicted),
        _repeat([2.0, 4.0, 1.0, 3.0], predicted),
        _repeat([1.0, 1.0, 4.0, 9.0], predicted),
    ]
    assert calibration.against_the_others(repeats, "measured_s")[0] == pytest.approx(1 / math.sqrt(22.5))


def test_spearman_within_each_micro_batch_count() -> None:
    """Groups of 4 or more layouts with one micro-batch count, each ranked on its own: the trend between
    the groups (more micro-batches, slower) does not enter; the group of 2 is left out."""
    micros = [1, 1, 1, 1, 2, 2, 2, 2, 4, 4]
    ranked = [SimpleNamespace(candidate=SimpleNamespace(micro=m)) for m in micros]
    predicted = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    measured = [14.0, 13.0, 12.0, 11.0, 21.0, 23.0, 22.0, 24.0, 1.0, 2.0]
    assert calibration.by_micro(ranked, predicted, measured) == pytest.approx({1: -1.0, 2: 0.8})
