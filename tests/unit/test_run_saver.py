"""What every rank's part of a save checks before rank 0 publishes it."""

from __future__ import annotations

from pathlib import Path

from moekit.run.saver import _unseen


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
