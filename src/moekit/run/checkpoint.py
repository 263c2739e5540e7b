"""Publishing checkpoints so that they are complete or absent.

A checkpoint is written under a temporary name (``.tmp-step_*``), fsynced, then published by an atomic
rename (an existing checkpoint of the same step is swapped out in one step, never deleted first);
``latest`` is updated last, each rename followed by an fsync of the directory. Temporary directories
left by a crashed save are never read (``layout.py``), and are removed when the next run starts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_model
from torch import nn

from moekit.errors import MoekitError, OptionError
from moekit.fileio import fsync_dir, replace_dir, write_bytes_atomic
from moekit.run.layout import (
    CONFIG,
    LATEST,
    MODEL_FILE,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    staging_dir,
    step_dir,
    step_dirs,
)
from moekit.run.manifest import Digests, checkpoint_files, digests, write_manifest

STALE = (".tmp-step_*", ".old-step_*", f".{LATEST}.*.tmp")  # what crashed saves leave behind


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """An empty staging directory for step ``step`` (a stale one from a crashed writer is removed)."""
    tmp = staging_dir(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def remove_stale(run_dir: Path) -> list[Path]:
    """Remove what crashed saves left in the checkpoint directory (staging directories, a half-swapped
    checkpoint, ``latest``'s temp files); returns what was removed. Call before the run's first save,
    on one process: it would delete another writer's staging directory."""
    root = checkpoint_dir(run_dir)
    for aside in root.glob(".old-step_*"):
        # A swap that renamed the old checkpoint aside and crashed before the new one took its name:
        # the aside copy is the only one, so it goes back.
        name = aside.name.removeprefix(".old-").rsplit("-", 1)[0]
        if not (root / name).exists():
            os.replace(aside, root / name)
    stale = sorted(p for pattern in STALE for p in root.glob(pattern))
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def publish_checkpoint(run_dir: Path, tmp: Path, step: int, files: Digests, info: dict[str, Any], keep: int) -> Path:
    """Write the manifest (every file's size and SHA-256), rename ``tmp`` to its final name, then point
    ``latest`` at it and keep the newest ``keep``: readers see the checkpoint complete or not at all."""
    root = checkpoint_dir(run_dir)
    final = step_dir(run_dir, step)
    write_manifest(tmp, step, files, info)
    replace_dir(tmp, final)
    write_bytes_atomic(root / LATEST, final.name.encode())
    _prune(root, keep, final)
    return final


def save_failed(run_dir: Path, step: int, err: BaseException) -> CheckpointError:
    """The error of a save that did not complete, saying which checkpoint is still the latest."""
    shutil.rmtree(staging_dir(run_dir, step), ignore_errors=True)
    previous = latest_checkpoint(run_dir)
    kept = f"; {previous} is intact" if previous else ""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).strip().splitlines()[0]
    final = step_dir(run_dir, step)
    return CheckpointError(f"could not save checkpoint {final}: {reason[:300]}{kept}")


WriteWeights = Callable[[Path], tuple[int, str]]  # writes model.safetensors at the path; (bytes, SHA-256)


def save_checkpoint(
    run_dir: Path, step: int, weights: nn.Module | WriteWeights, info: dict[str, Any], keep: int
) -> Path:
    """Write a weights-only checkpoint of step ``step`` atomically (what ``convert`` and ``upcycle``
    write): one ``model.safetensors``, of a model's weights or written by ``weights(path)`` (a
    conversion streamed tensor by tensor, which hashes what it writes).

    On any I/O error the partial files are removed and the previous checkpoint stays the latest.
    """
    try:
        tmp = begin_checkpoint(run_dir, step)
        if isinstance(weights, nn.Module):
            save_model(weights, str(tmp / MODEL_FILE))
            files = digests(tmp, checkpoint_files(tmp))
        else:
            files = {MODEL_FILE: weights(tmp / MODEL_FILE)}
            fsync_dir(tmp)
        return publish_checkpoint(run_dir, tmp, step, files, info, keep)
    except MoekitError:  # the input was at fault (a conversion's source): reported as it is
        shutil.rmtree(staging_dir(run_dir, step), ignore_errors=True)
        raise
    except Exception as err:  # OSError from our writes; torch and safetensors wrap theirs in RuntimeError
        raise save_failed(run_dir, step, err) from None


def save_weights_run(
    run_dir: Path, config_json: str, weights: nn.Module | WriteWeights, tokenizer: Any, source: str
) -> Path:
    """A run directory holding only weights, at step 0: what ``convert`` and ``upcycle`` write.

    ``config.json``, the tokenizer (anything with ``save(directory)``) and one checkpoint without
    optimizer state (``weights``: see ``save_checkpoint``); ``moekit train --init RUN_DIR`` starts
    training from it.
    """
    run_dir = Path(run_dir)
    if latest_checkpoint(run_dir) is not None:
        raise OptionError("run_dir", "already holds a run; choose another directory", run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(run_dir / CONFIG, config_json.encode())
    tokenizer.save(run_dir)
    return save_checkpoint(run_dir, 0, weights, {"source": source}, keep=1)


def _prune(root: Path, keep: int, newest: Path) -> None:
    steps = step_dirs(root)
    for old in steps[:-keep]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)
