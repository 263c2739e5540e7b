"""Checkpoints that are complete or absent.

Layout: ``<run_dir>/checkpoints/step_000100/{model.safetensors, trainer.pt, manifest.json}`` and a
``latest`` file naming the newest complete one. A checkpoint is written under a temporary name,
fsynced, then published by an atomic rename; ``latest`` is updated last. The manifest holds each
file's SHA-256, checked on load, so a truncated or corrupted file is reported by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from moekit.train.fileio import fsync_file, write_bytes_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
MANIFEST = "manifest.json"


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
    if not (target / MANIFEST).is_file():
        raise CheckpointError(f"{pointer} names {target.name}, which is missing or incomplete")
    return target


def save_checkpoint(
    run_dir: Path, step: int, model: nn.Module, trainer_state: dict[str, Any], info: dict[str, Any], keep: int
) -> Path:
    """Write step ``step`` atomically, point ``latest`` at it and keep the newest ``keep``.

    ``trainer_state`` (optimizer, RNG states, ...) goes through ``torch.save``; ``info`` (JSON-able)
    into the manifest. On any I/O error the partial files are removed and the previous checkpoint
    stays the latest.
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_model(model, str(tmp / MODEL_FILE))
        torch.save(trainer_state, tmp / TRAINER_FILE)
        files = {name: _sha256(tmp / name) for name in (MODEL_FILE, TRAINER_FILE)}
        for name in files:
            fsync_file(tmp / name)
        manifest = {"step": step, "files": files, **info}
        write_bytes_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_bytes_atomic(root / LATEST, final.name.encode())
    except Exception as err:  # OSError from our writes; torch and safetensors wrap theirs in RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        kept = f"; {previous} is intact" if previous else ""
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
        raise CheckpointError(f"could not save checkpoint {final}: {reason}{kept}") from None
    _prune(root, keep, final)
    return final


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
    return save_checkpoint(run_dir, 0, model, {}, {"source": source}, keep=1)


def _prune(root: Path, keep: int, newest: Path) -> None:
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.removeprefix("step_")))
    for old in steps[:-keep]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` after checking every file against its SHA-256."""
    manifest_path = Path(path) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable checkpoint manifest ({err})") from None
    for name, expected in manifest["files"].items():
        file = Path(path) / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the checkpoint")
        if _sha256(file) != expected:
            raise CheckpointError(f"{file}: corrupt (checksum mismatch; truncated or modified)")
    return manifest


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load a checkpoint's weights into ``model``; a shape or key mismatch names the keys."""
    try:
        missing, unexpected = load_model(model, str(Path(path) / MODEL_FILE), strict=False)
    except RuntimeError as err:  # safetensors reports size mismatches this way
        first = str(err).strip().splitlines()
        raise CheckpointError(f"{Path(path) / MODEL_FILE}: does not fit this model: {' '.join(first[-2:])}") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{Path(path) / MODEL_FILE}: does not fit this model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / TRAINER_FILE, weights_only=True)
