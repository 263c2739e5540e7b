"""A checkpoint's manifest: each file's size and SHA-256, beside what the run records about the step
(data position, layout, losses). Checked on load, so a truncated, corrupted or missing file is
reported by name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from moekit.fileio import fsync_dir, fsync_file, write_bytes_atomic
from moekit.run.layout import MANIFEST, CheckpointError

Digests = dict[str, tuple[int, str]]  # file (relative to the checkpoint) -> (size, SHA-256)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(tmp: Path) -> list[str]:
    """Every file of a staged checkpoint, as sorted relative paths (the manifest's keys)."""
    return sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)


def digests(tmp: Path, names: list[str]) -> Digests:
    """(size, SHA-256) of ``names`` (after flushing them, and the directories naming them, to disk):
    the files one rank wrote."""
    out = {}
    for name in names:
        fsync_file(tmp / name)
        out[name] = ((tmp / name).stat().st_size, _sha256(tmp / name))
    for directory in sorted({(tmp / name).parent for name in names}):
        fsync_dir(directory)
    return out


def write_manifest(tmp: Path, step: int, files: Digests, info: dict[str, Any]) -> None:
    """Write the manifest of the checkpoint staged in ``tmp``: ``files``' sizes and digests and ``info``."""
    files = dict(sorted(files.items()))
    manifest = {
        "step": step,
        "files": {name: sha for name, (_, sha) in files.items()},
        "sizes": {name: size for name, (size, _) in files.items()},
        **info,
    }
    write_bytes_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())


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
