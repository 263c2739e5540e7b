"""Where a run directory keeps its checkpoints, and which of them are published.

``<run_dir>/checkpoints/step_000100/{manifest.json, sharded/ (training state, see sharded.py),
model.safetensors (one file of weights, when written by one process)}`` and a ``latest`` file naming
the newest complete one. Only ``step_N`` directories are ever read: what a save is writing, or a
crashed one left behind (``.tmp-step_*``), is not.
"""

from __future__ import annotations

import re
from pathlib import Path

from moekit.errors import MoekitError

CONFIG = "config.json"  # the run's configuration (``RunConfig.to_json``)
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
MANIFEST = "manifest.json"
SHARDED = "sharded"  # the DCP directory of a checkpoint
STEP_NAME = re.compile(r"step_\d+")  # a published checkpoint; anything else (``.tmp-*``) is never read


class CheckpointError(MoekitError):
    """A checkpoint could not be written or read; the message names the file."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir(run_dir: Path, step: int) -> Path:
    """The name step ``step`` is published under."""
    return checkpoint_dir(run_dir) / f"step_{step:06d}"


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where step ``step`` is written before it is published (every rank writes there under DCP)."""
    return checkpoint_dir(run_dir) / f".tmp-step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None if it has none."""
    root = checkpoint_dir(run_dir)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    target = root / pointer.read_text().strip()
    if not STEP_NAME.fullmatch(target.name) or not (target / MANIFEST).is_file():
        raise CheckpointError(f"{pointer} names {target.name}, which is missing or incomplete")
    return target


def step_dirs(root: Path) -> list[Path]:
    """Published checkpoint directories (named ``step_N``) under ``root``, oldest first."""
    steps = [p for p in root.glob("step_*") if STEP_NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(steps, key=lambda p: int(p.name.removeprefix("step_")))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Published checkpoints, newest first (whatever their files' state: ``read_manifest`` checks that)."""
    return [p for p in reversed(step_dirs(checkpoint_dir(run_dir))) if (p / MANIFEST).is_file()]


def is_sharded(path: Path) -> bool:
    """True for a checkpoint written as DCP shards with no consolidated ``model.safetensors``."""
    return not (Path(path) / MODEL_FILE).is_file() and (Path(path) / SHARDED).is_dir()
