"""The loop's schedules, each on its own: when evaluations and saves are due, and how a streak of skipped
steps is counted (carried over a resume) and stops the run."""

from __future__ import annotations

from moekit.train.schedules import Every, NonFiniteStreak


def test_every_is_due_on_its_multiples_and_at_the_last_step() -> None:
    assert [s for s in range(1, 11) if Every(4, 10).due(s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if Every(0, 10).due(s)] == [10], "0: at the last step only"
    assert [s for s in range(1, 7) if Every(1, 6).due(s)] == [1, 2, 3, 4, 5, 6]


def test_a_streak_counts_skips_in_a_row_and_stops_at_its_limit() -> None:
    streak = NonFiniteStreak(limit=3, skipped=1, streak=1)  # as a manifest hands them to a resumed run
    for skipped in (True, False, True, True):
        streak.count(skipped)
        assert not streak.exceeded
    assert (streak.skipped, streak.streak) == (4, 2)
    streak.count(True)
    assert streak.exceeded and streak.skipped == 5
    assert streak.stop(9).startswith("gradient norm is not finite for 3 steps in a row at step 9 ")
    assert "(3 in a row; train.max_nonfinite_steps=3)" in streak.warning(9, float("nan"))
