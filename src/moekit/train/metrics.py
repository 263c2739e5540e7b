"""Per-step training metrics: an append-only JSONL file (the record of truth) mirrored to TensorBoard.

A record is one dict per optimizer step, e.g. ``{"step": 12, "loss": 3.21, "lr": 6e-4,
"load_cv": [0.21, 0.10], "expert_load": [[0.1, 0.2, ...], ...], "val_loss": 3.30}``: scalars,
per-MoE-layer lists and per-layer per-expert lists of lists.

Resuming: a resumed run re-logs from its checkpoint step, so the file may hold an abandoned tail.
A record whose step does not exceed the step before it starts a new segment that replaces every
earlier record at or after its step; ``read_metrics`` and TensorBoard (through ``purge_step``) both
apply that rule, so the curves show one history without duplicates.
"""

from __future__ import annotations

import json
import numbers
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# NOTE: a TensorBoard histogram costs about 1 ms per MoE layer (a few percent of a small CPU step),
# so per-expert histograms go out on every 10th step and on evaluation steps; scalars every step.
HISTOGRAM_EVERY = 10

_warned_no_tensorboard = False


class MetricsLogger:
    """Writes each step's record to ``<run_dir>/metrics.jsonl`` and to TensorBoard under ``<run_dir>/tensorboard``.

    The JSONL file is appended to (a resumed run continues it) and flushed after every record so a
    crash loses at most the line being written. TensorBoard is optional: without the
    ``tensorboard`` package the logger warns once on stderr and writes JSONL only.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if self.path.exists():
            _drop_partial_last_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- open until close()
        self._writer_cls = _summary_writer_cls() if tensorboard else None
        self._writer: Any = None  # created on the first record, which gives the purge step

    def log(self, record: dict[str, Any]) -> None:
        """Append one step's record; ``record["step"]`` (an int) is required."""
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ValueError(f"metrics record needs an integer 'step', got {step!r} in {record!r}")
        line = json.dumps(record, default=_to_builtin)
        # NOTE: flush() hands the line to the OS, which survives a process crash; an fsync per step
        # would also survive a machine crash but costs a disk round-trip on every optimizer step.
        self._file.write(line + "\n")
        self._file.flush()
        if self._writer_cls is not None:
            # Round-trip through JSON so TensorBoard sees exactly what the file holds, as plain Python types.
            self._log_tensorboard(json.loads(line))

    def _log_tensorboard(self, record: dict[str, Any]) -> None:
        step = record["step"]
        histograms = step % HISTOGRAM_EVERY == 0 or "val_loss" in record
        if self._writer is None:
            # NOTE: purge_step hides earlier events at or after this step, so a resumed run that
            # re-logs from its checkpoint replaces the abandoned tail instead of zigzagging over it.
            self._writer = self._writer_cls(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=step)
        for name, value in record.items():
            if name == "step":
                continue
            if _is_number(value):
                self._writer.add_scalar(name, value, step)
            elif isinstance(value, list) and all(_is_number(v) for v in value):
                for layer, v in enumerate(value):
                    self._writer.add_scalar(f"{name}/layer{layer}", v, step)
            elif (
                histograms
                and isinstance(value, list)
                and all(isinstance(v, list) and all(map(_is_number, v)) for v in value)
            ):
                # Per-expert values: one histogram per layer keeps the dashboard to one card per layer
                # (64 experts as scalars would be 64 cards); expert identity lives in plots.py's heatmap.
                for layer, values in enumerate(value):
                    if values:
                        self._writer.add_histogram(f"{name}/layer{layer}", np.asarray(values, dtype=float), step)

    def close(self) -> None:
        """Flush and close the JSONL file and the TensorBoard writer; safe to call twice."""
        self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's records sorted by step, one per step, with resumed segments replacing what they re-logged.

    A last line without its newline is a write cut short by a crash and is skipped; any other line
    that is not a JSON object raises ``ValueError`` naming the file and line number.
    """
    path = Path(run_dir) / METRICS_FILE
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept: list[dict[str, Any]] = []  # invariant: strictly increasing steps
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{lineno}: corrupt metrics line ({e.msg}): {line[:80]!r}") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with an integer 'step', got {line[:80]!r}")
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


def mean_expert_loads(run_dir: Path, num_experts: int, last: int = 50) -> list[list[float]]:
    """Per MoE layer, each expert's share of the routed tokens averaged over the run's last logged steps."""
    records = [r["expert_load"] for r in read_metrics(run_dir) if r.get("expert_load")][-last:]
    if not records:
        raise ValueError(f"{run_dir}: its metrics.jsonl has no expert_load records")
    if any(len(layer) != num_experts for layer in records[-1]):
        raise ValueError(f"{run_dir}: its layers do not have the model's {num_experts} experts")
    return [[sum(r[i][e] for r in records) / len(records) for e in range(num_experts)] for i in range(len(records[-1]))]


def _drop_partial_last_line(path: Path) -> None:
    """Cut a crash's unterminated last line so the next record does not get glued onto it."""
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos = end
        while pos > 0:  # scan back in chunks: lines holding expert_load for many layers can be long
            start = max(0, pos - (1 << 16))
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            pos = start
        f.truncate(0)


def _summary_writer_cls() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or None (with a one-time warning) when tensorboard is missing."""
    global _warned_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _warned_no_tensorboard:
            print("moekit: tensorboard is not installed, logging metrics to metrics.jsonl only", file=sys.stderr)
            _warned_no_tensorboard = True
        return None
    return SummaryWriter


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float))


def _to_builtin(value: Any) -> Any:
    """JSON fallback for numpy and torch values (scalars and arrays both have ``tolist``)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"metrics value {value!r} of type {type(value).__name__} is not JSON serialisable")
