"""Directory replacement with real files: the new directory is swapped in and the old one is never missing."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from moekit import fileio


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


@pytest.mark.slow
def test_replacing_a_checkpoint_never_leaves_it_missing(tmp_path: Path) -> None:
    """A reader polling the checkpoint while it is replaced 50 times always finds its manifest
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
        for i in range(1, 51):
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
    assert (final / "manifest.json").read_text() == "50"
