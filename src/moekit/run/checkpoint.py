"""Checkpoints that are complete or absent.

Layout: ``<run_dir>/checkpoints/step_000100/{manifest.json, sharded/ (training state, see
sharded.py), model.safetensors (one file of weights, when written by one process)}`` and a ``latest``
file naming the newest complete one. A checkpoint is written under a temporary name (``.tmp-step_*``),
fsynced, then published by an atomic rename (an existing checkpoint of the same step is swapped out in
one step, never deleted first); ``latest`` is updated last, each rename followed by an fsync of the
directory. Temporary directories left by a crashed save are never read, and are removed when the next
run starts. The manifest holds each file's size and SHA-256, checked on load, so a truncated,
corrupted or missing file is reported by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load_model, save_model
from torch import nn

from moekit.fileio import fsync_dir, fsync_file, replace_dir, write_bytes_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
MANIFEST = "manifest.json"
SHARDED = "sharded"  # the DCP directory of a checkpoint
STEP_NAME = re.compile(r"step_\d+")  # a published checkpoint; anything else (``.tmp-*``) is never read
STALE = (".tmp-step_*", ".old-step_*", f".{LATEST}.*.tmp")  # what crashed saves leave behind


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


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


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where step ``step`` is written before it is published (every rank writes there under DCP)."""
    return checkpoint_dir(run_dir) / f".tmp-step_{step:06d}"


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


def checkpoint_files(tmp: Path) -> list[str]:
    """Every file of a staged checkpoint, as sorted relative paths (the manifest's keys)."""
    return sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)


def digests(tmp: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    """(size, SHA-256) of ``names`` (after flushing them, and the directories naming them, to disk):
    the files one rank wrote."""
    out = {}
    for name in names:
        fsync_file(tmp / name)
        out[name] = ((tmp / name).stat().st_size, _sha256(tmp / name))
    for directory in sorted({(tmp / name).parent for name in names}):
        fsync_dir(directory)
    return out


def publish_checkpoint(
    run_dir: Path, tmp: Path, step: int, files: dict[str, tuple[int, str]], info: dict[str, Any], keep: int
) -> Path:
    """Write the manifest (every file's size and SHA-256), rename ``tmp`` to its final name, then point
    ``latest`` at it and keep the newest ``keep``: readers see the checkpoint complete or not at all."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:06d}"
    files = dict(sorted(files.items()))
    manifest = {
        "step": step,
        "files": {name: sha for name, (_, sha) in files.items()},
        "sizes": {name: size for name, (size, _) in files.items()},
        **info,
    }
    write_bytes_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
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
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    return CheckpointError(f"could not save checkpoint {final}: {reason[:300]}{kept}")


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, info: dict[str, Any], keep: int) -> Path:
    """Write a weights-only checkpoint of step ``step`` atomically (what ``convert`` and ``upcycle``
    write): one ``model.safetensors``.

    On any I/O error the partial files are removed and the previous checkpoint stays the latest.
    """
    try:
        tmp = begin_checkpoint(run_dir, step)
        save_model(model, str(tmp / MODEL_FILE))
        return publish_checkpoint(run_dir, tmp, step, digests(tmp, checkpoint_files(tmp)), info, keep)
    except Exception as err:  # OSError from our writes; torch and safetensors wrap theirs in RuntimeError
        raise save_failed(run_dir, step, err) from None


def save_weights_run(run_dir: Path, config_json: str, model: nn.Module, tokenizer: Any, source: str) -> Path:
    """A run directory holding only weights, at step 0: what ``convert`` and ``upcycle`` write.

    ``config.json``, the tokenizer (anything with ``save(directory)``) and one checkpoint without
    optimizer state; ``moekit train --init RUN_DIR`` starts training from it.
    """
    run_dir = Path(run_dir)
    if latest_checkpoint(run_dir) is not None:
        raise CheckpointError(f"{run_dir} already holds a run: choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(run_dir / "config.json", config_json.encode())
    tokenizer.save(run_dir)
    return save_checkpoint(run_dir, 0, model, {"source": source}, keep=1)


def _steps(root: Path) -> list[Path]:
    """Published checkpoint directories (named ``step_N``), oldest first."""
    steps = [p for p in root.glob("step_*") if STEP_NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(steps, key=lambda p: int(p.name.removeprefix("step_")))


def _prune(root: Path, keep: int, newest: Path) -> None:
    steps = _steps(root)
    for old in steps[:-keep]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Published checkpoints, newest first (whatever their files' state: ``read_manifest`` checks that)."""
    return [p for p in reversed(_steps(checkpoint_dir(run_dir))) if (p / MANIFEST).is_file()]


def load_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, its files not checked."""
    manifest_path = Path(path) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable checkpoint manifest ({err})") from None
    _check_manifest(manifest, manifest_path)
    return manifest


def _check_manifest(manifest: Any, where: Path) -> None:
    """CheckpointError naming the first field a moekit manifest lacks or holds in the wrong form."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: not a checkpoint manifest (a JSON object)")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: field 'step' must be a step number, got {step!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise CheckpointError(f"{where}: field 'files' must map each file to its SHA-256, got {files!r:.80}")
    if not isinstance(manifest.get("sizes", {}), dict):
        raise CheckpointError(f"{where}: field 'sizes' must map each file to its byte count")
    for name in ("global_microbatches", "skipped_steps", "nonfinite_streak", "world"):
        value = manifest.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{where}: field {name!r} must be a whole number >= 0, got {value!r}")


def read_manifest(path: Path, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` after checking its files against their SHA-256.

    ``share=(i, n)`` checks only every n-th file from the i-th: n ranks check a checkpoint together.
    """
    manifest = load_manifest(path)
    sizes = manifest.get("sizes", {})  # absent from checkpoints written before sizes were recorded
    index, count = share
    for name, expected in sorted(manifest["files"].items())[index::count]:
        file = Path(path) / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the checkpoint")
        size = file.stat().st_size
        if name in sizes and size != sizes[name]:
            raise CheckpointError(f"{file}: corrupt (size mismatch: {size} bytes, the manifest says {sizes[name]})")
        if _sha256(file) != expected:
            raise CheckpointError(f"{file}: corrupt (checksum mismatch; truncated or modified)")
    return manifest


def is_sharded(path: Path) -> bool:
    """True for a checkpoint written as DCP shards with no consolidated ``model.safetensors``."""
    return not (Path(path) / MODEL_FILE).is_file() and (Path(path) / SHARDED).is_dir()


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load a checkpoint's weights into ``model``; a shape or key mismatch names the keys.

    A sharded checkpoint is consolidated in memory (every shard read in this process).
    """
    if is_sharded(path):
        from moekit.run.sharded import load_weights  # sharded.py builds on this module

        load_weights(Path(path) / SHARDED, model)
        return
    try:
        missing, unexpected = load_model(model, str(Path(path) / MODEL_FILE), strict=False)
    except RuntimeError as err:  # safetensors reports size mismatches this way
        first = str(err).strip().splitlines()
        raise CheckpointError(f"{Path(path) / MODEL_FILE}: does not fit this model: {' '.join(first[-2:])}") from None
    unexpected = [k for k in unexpected if k not in model.state_dict()]  # a tied weight's second name
    if missing or unexpected:
        raise CheckpointError(
            f"{Path(path) / MODEL_FILE}: does not fit this model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
