"""Reader threads and the writer thread: a region's read waits for its last write, a buffer is not read
into (or handed back) while a write out of it is still running, and ``flush`` waits for everything.
The moves are real file I/O on a ``RegionFile``; a write is held back by an event the test sets."""

from __future__ import annotations

import threading
from pathlib import Path

from moekit.storage.aligned import DIRECT_ALIGN
from moekit.storage.files import StorageFile
from moekit.storage.regions import RegionFile
from moekit.storage.transfers import Transfers

WHOLE = [(0, DIRECT_ALIGN)]


def test_reads_wait_for_the_region_s_write_and_buffers_for_the_write_out_of_them(tmp_path: Path) -> None:
    regions = RegionFile(StorageFile.claim(tmp_path / "r.bin"), ["a", "b"], DIRECT_ALIGN)
    io = Transfers()
    gate = threading.Event()
    try:
        out = regions.buffer().fill_(7)

        def slow_write() -> None:
            gate.wait(timeout=60)
            regions.transfer("a", out, WHOLE, write=True)

        io.write("a", out, slow_write)
        into = regions.buffer().fill_(0)
        read = io.read("a", into, lambda: regions.transfer("a", into, WHOLE, write=False))
        other = regions.buffer().fill_(0)
        unrelated = io.read("b", other, lambda: regions.transfer("b", other, WHOLE, write=False))
        unrelated.result(timeout=60)  # another region's read does not wait for the write
        assert not read.done(), "the read of region a waits for its write"
        gate.set()
        read.result(timeout=60)
        assert (into == 7).all(), "the read saw what the write put there"

        gate.clear()
        io.write("b", out, slow_write)  # the write out of ``out`` is held
        reuse = io.read("a", out, lambda: regions.transfer("a", out, WHOLE, write=False))
        assert not reuse.done(), "nothing is read into a buffer a write is still taking from"
        gate.set()
        io.flush()
        assert reuse.done() and regions.bytes_written == 2 * DIRECT_ALIGN
    finally:
        gate.set()
        io.close()
        regions.remove()
