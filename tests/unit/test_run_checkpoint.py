"""Checkpoint durability with real files: staging directories of crashed saves are removed and never
read, a checkpoint replaced by one of the same step is never missing, renames are followed by an
fsync of their directory, and a manifest naming a file rank 0 cannot see fails the save."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from torch import nn

from moekit import fileio
from moekit.run.checkpoint import begin_checkpoint, publish_checkpoint, save_checkpoint
from moekit.run.layout import CheckpointError, checkpoint_dir, complete_checkpoints, latest_checkpoint
from moekit.run.manifest import digests, read_manifest
from moekit.run.saver import Checkpointer, _unseen


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


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_replace_dir_swaps_in_the_new_directory(tmp_path: Path, monkeypatch, exchange: bool) -> None:
    if not exchange:
        monkeypatch.setattr(fileio, "_exchange", lambda a, b: False)  # a filesystem without it (NFS)
    final, new = tmp_path / "step_000004", tmp_path / ".tmp-step_000004"
    for path, text in ((final, "old"), (new, "new")):
        path.mkdir()
        (path / "manifest.json").write_text(text)
    fileio.replace_dir(new, final)
    assert (final / "manifest.json").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["step_000004"]  # the old one is gone, nothing aside


def test_replacing_a_checkpoint_never_leaves_it_missing(tmp_path: Path) -> None:
    """A reader polling the checkpoint while it is replaced 200 times always finds its manifest
    (delete-then-rename fails this within a few replacements)."""
    final = tmp_path / "step_000004"
    final.mkdir()
    (final / "manifest.json").write_text("0")
    missing, stop = [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            if not (final / "manifest.json").is_file():
                missing.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(1, 201):
            new = tmp_path / ".tmp-step_000004"
            new.mkdir()
            for j in range(20):  # a few files, so removing the old one takes a while
                (new / f"shard{j}").write_bytes(b"x")
            (new / "manifest.json").write_text(str(i))
            fileio.replace_dir(new, final)
    finally:
        stop.set()
        reader.join()
    assert not missing, f"the checkpoint was missing {len(missing)} times"
    assert (final / "manifest.json").read_text() == "200"


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


def test_a_file_rank_0_cannot_see_fails_the_save(tmp_path: Path) -> None:
    """The manifest comes from what each rank wrote: a shard on another node's local disk is named."""
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "__0_0.distcp").write_bytes(b"abc")
    every = [{"sharded/__0_0.distcp": (3, "x")}, {"sharded/__1_0.distcp": (5, "y")}]
    message = _unseen(tmp_path, every)
    assert message is not None
    assert "must be one filesystem shared by every node" in message
    assert "sharded/__1_0.distcp (written by rank 1: 5 bytes; here: missing)" in message
    assert _unseen(tmp_path, every[:1]) is None
