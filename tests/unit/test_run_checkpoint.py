"""Checkpoint durability with real files: staging directories of crashed saves are removed and never
read, a swap cut halfway gets its checkpoint back, renames are followed by an fsync of their
directory, and a truncated file is named by its size."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from moekit import fileio
from moekit.run.checkpoint import begin_checkpoint, publish_checkpoint, save_checkpoint
from moekit.run.layout import CheckpointError, checkpoint_dir, complete_checkpoints, latest_checkpoint
from moekit.run.manifest import digests, read_manifest
from moekit.run.saver import Checkpointer


def _run_with_step_2(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    save_checkpoint(run, 2, nn.Linear(4, 4), {}, keep=5)
    return run


def _fake_checkpoint(path: Path) -> None:
    """A directory that looks complete (a manifest) but was never published."""
    path.mkdir(parents=True)
    (path / "manifest.json").write_text('{"step": 4, "files": {}}')


def test_stale_staging_dirs_are_ignored_then_removed(tmp_path: Path) -> None:
    run = _run_with_step_2(tmp_path)
    root = checkpoint_dir(run)
    stale = [root / ".tmp-step_000004", root / ".old-step_000002-0badc0de"]
    for path in stale:
        _fake_checkpoint(path)
    (root / ".latest.123-0badc0de.tmp").write_text(".tmp-step_000004")
    assert complete_checkpoints(run) == [root / "step_000002"]  # never read, though newer and complete
    assert latest_checkpoint(run) == root / "step_000002"

    with Checkpointer(run, keep=2, background=False):  # rank 0, before its first save
        pass
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]


def test_a_swap_cut_after_renaming_aside_gets_its_checkpoint_back(tmp_path: Path) -> None:
    # Without an atomic exchange the old checkpoint is renamed aside first; a crash before the new one
    # takes its name leaves the aside copy as the only one, and it must not be deleted as stale.
    run = _run_with_step_2(tmp_path)
    root = checkpoint_dir(run)
    (root / "step_000002").rename(root / ".old-step_000002-0badc0de")
    _fake_checkpoint(root / ".tmp-step_000002")
    with Checkpointer(run, keep=2, background=False):  # rank 0, before its first save
        pass
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
    assert read_manifest(latest_checkpoint(run))["step"] == 2


def test_latest_naming_a_staging_dir_is_refused(tmp_path: Path) -> None:
    run = _run_with_step_2(tmp_path)
    _fake_checkpoint(checkpoint_dir(run) / ".tmp-step_000004")
    (checkpoint_dir(run) / "latest").write_text(".tmp-step_000004")
    with pytest.raises(CheckpointError, match=r"latest names .tmp-step_000004, which is missing or incomplete"):
        latest_checkpoint(run)


def test_publish_fsyncs_the_directory_after_each_rename(tmp_path: Path, monkeypatch) -> None:
    run = _run_with_step_2(tmp_path)
    tmp = begin_checkpoint(run, 2)  # the same step again: swapped with the published one
    (tmp / "weights").write_bytes(b"new")
    files = digests(tmp, ["weights"])
    events: list[str] = []
    monkeypatch.setattr(fileio, "fsync_dir", lambda path: events.append(f"fsync {Path(path).name}"))
    real_replace = fileio.os.replace
    monkeypatch.setattr(
        fileio.os, "replace", lambda a, b: (events.append(f"rename {Path(b).name}"), real_replace(a, b))
    )
    publish_checkpoint(run, tmp, 2, files, {}, keep=5)
    assert events == [
        "rename manifest.json",
        "fsync .tmp-step_000002",
        "fsync checkpoints",  # step_000002 swapped in (renameat2, no os.replace)
        "rename latest",
        "fsync checkpoints",
    ]
    manifest = read_manifest(latest_checkpoint(run))
    assert manifest["files"].keys() == {"weights"} and manifest["sizes"] == {"weights": 3}


def test_a_truncated_file_is_named_by_its_size(tmp_path: Path) -> None:
    run = _run_with_step_2(tmp_path)
    weights = latest_checkpoint(run) / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(
        CheckpointError, match=rf"model.safetensors: corrupt \(size mismatch: {size - 8} bytes, .* {size}"
    ):
        read_manifest(latest_checkpoint(run))
