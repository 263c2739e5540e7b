"""Regions of a file in two tiers: a region moved to the host tier is read once from the file, then read
and written as memory copies (counted apart), the file keeping its room and its old bytes."""

from __future__ import annotations

from pathlib import Path

import torch

from moekit.storage.aligned import DIRECT_ALIGN
from moekit.storage.files import StorageFile
from moekit.storage.regions import RegionFile

WHOLE = [(0, DIRECT_ALIGN)]


def test_a_host_tier_region_moves_by_memory_copy(tmp_path: Path) -> None:
    regions = RegionFile(StorageFile.claim(tmp_path / "r.bin"), ["a", "b"], DIRECT_ALIGN)
    try:
        first = regions.buffer().fill_(3)
        regions.transfer("a", first, WHOLE, write=True)
        regions.move_to_host(["a"])  # read once from the file
        assert sorted(regions.host) == ["a"] and regions.bytes_read == DIRECT_ALIGN
        regions.transfer("a", regions.buffer().fill_(5), WHOLE, write=True)
        got = regions.buffer()
        regions.transfer("a", got, [(0, 8)], write=False)
        assert torch.equal(got[:8], torch.full((8,), 5, dtype=torch.uint8))
        assert regions.host_bytes_written == DIRECT_ALIGN and regions.host_bytes_read == 8
        assert regions.bytes_written == DIRECT_ALIGN, "the file was not written for the held region"
        assert (tmp_path / "r.bin").read_bytes()[:DIRECT_ALIGN] == bytes([3]) * DIRECT_ALIGN
    finally:
        regions.remove()
