"""Aligned regions in a file: equal regions of ``unit`` bytes (whole 4 KiB blocks), named by key, each
read or written whole or in spans, in whichever tier holds it.

A region starts and ends on a 4 KiB boundary, so a whole region (or any span of whole blocks) moves
with one direct (``O_DIRECT``) call into an aligned RAM buffer (``buffer``): no copy through the OS
page cache and no cached pages beside a memory budget; where the filesystem refuses direct I/O the
file's buffered descriptor moves it. Keys moved to a ``HostTier`` (``move_to_host``) are read and
written as memory copies instead, counted apart from the disk's bytes; the file keeps their room.
Offloaded training keeps each MoE layer's expert weights, gradients and AdamW moments here, one
region per (layer, kind).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

from torch import Tensor

from moekit.storage.aligned import DIRECT_ALIGN, aligned_empty
from moekit.storage.files import StorageFile
from moekit.storage.host import HostTier

Spans = list[tuple[int, int]]  # byte spans [start, end) of a region, sorted and disjoint


class RegionFile:
    """``keys`` regions of ``unit`` bytes in a claimed ``file`` (given its room here); thread-safe for
    transfers of different regions."""

    def __init__(self, file: StorageFile, keys: Sequence[Hashable], unit: int) -> None:
        assert unit % DIRECT_ALIGN == 0, "regions of whole blocks"
        self.file, self.path, self.unit = file, file.path, unit
        self._index = {key: i for i, key in enumerate(keys)}
        file.allocate(len(self._index) * unit)
        self.direct = file.direct
        self.host = HostTier((), unit, self._fill)  # none held until ``move_to_host``
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0  # disk bytes
        self.host_bytes_read = self.host_bytes_written = 0

    def buffer(self) -> Tensor:
        """A RAM buffer for one region, on a 4 KiB boundary (where direct I/O may land)."""
        return aligned_empty(self.unit)

    def move_to_host(self, keys: Sequence[Hashable]) -> None:
        """From now on hold ``keys``' regions in RAM (each read once from the file), not on disk."""
        self.host = HostTier(keys, self.unit, self._fill)

    def _fill(self, key: Hashable, buf_U8: Tensor) -> None:
        self.transfer(key, buf_U8, [(0, self.unit)], write=False)

    def transfer(self, key: Hashable, buf_U8: Tensor, spans: Spans, write: bool) -> None:
        """Move ``spans`` of ``buf_U8`` (one region's buffer) to (``write``) or from region ``key``, in
        whichever tier holds it; counted. A short disk transfer is an ``OSError`` naming the region."""
        assert buf_U8.numel() == self.unit and buf_U8.is_contiguous()
        held = self.host.get(key)
        base = self._index[key] * self.unit
        moved = 0
        for start, end in spans:
            span = buf_U8[start:end]
            if held is not None:
                (held[start:end].copy_(span) if write else span.copy_(held[start:end]))
            else:
                done = self.file.write(span, base + start) if write else self.file.read(span, base + start)
                if done != end - start:
                    what = "write" if write else "read"
                    raise OSError(f"{self.path}: short {what} of region {key}: {done} of {end - start} bytes")
            moved += end - start
        with self._lock:
            if held is not None and write:
                self.host_bytes_written += moved
            elif held is not None:
                self.host_bytes_read += moved
            elif write:
                self.bytes_written += moved
            else:
                self.bytes_read += moved

    def remove(self) -> None:
        """Remove the file (and the directories its claim made); the host tier's regions go too."""
        self.file.remove()
        self.host = HostTier((), self.unit, self._fill)
