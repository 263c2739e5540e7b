"""The training loop's schedules, each owning one concern: when to evaluate, when to save, and when a
streak of skipped (non-finite) steps stops the run. Interrupt agreement is ``interrupt.StopOnInterrupt``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Every:
    """Due every ``every`` steps (0: never on its own) and at the run's ``last`` step."""

    every: int
    last: int

    def due(self, step: int) -> bool:
        return step == self.last or (self.every > 0 and step % self.every == 0)


@dataclass
class NonFiniteStreak:
    """Steps skipped for a non-finite gradient norm: counted over the run, and in a row, until ``limit``
    in a row stops it. Both counts are carried in a checkpoint's manifest, so a resumed run counts (and
    stops) as the uninterrupted one would."""

    limit: int
    skipped: int = 0  # over the whole run
    streak: int = 0  # in a row, ending at the last step counted

    def count(self, skipped: bool) -> None:
        self.skipped += skipped
        self.streak = self.streak + 1 if skipped else 0

    @property
    def exceeded(self) -> bool:
        return self.streak >= self.limit

    def warning(self, step: int, grad_norm: float) -> str:
        """What a skipped step tells the user."""
        return (
            f"moekit: warning: gradient norm is {grad_norm} at step {step}: update skipped "
            f"({self.streak} in a row; train.max_nonfinite_steps={self.limit})"
        )

    def stop(self, step: int) -> str:
        """Why the run stops (the streak reached its limit)."""
        return (
            f"gradient norm is not finite for {self.streak} steps in a row at step {step} "
            f"(train.max_nonfinite_steps={self.limit}): training stopped; "
        )
