"""Reader threads and a writer thread: how bytes move between a slow tier and RAM beside the compute.

Reads run on ``READERS`` threads (one thread leaves the disk's queue shallow), writes on one thread in
the order they are submitted (a region written twice lands as the second write). Two orders are
kept, whatever thread runs what:

- a read of a region starts after that region's last write has reached it (the disk is the truth);
- a buffer is read into, or handed back to the caller to change, only after the write out of it has
  left it (``wait_buffer``).

Offloaded inference reads experts into cache slots through it; offloaded training reads and writes
its layers' regions. ``overlap=False`` makes every transfer finish before it returns (the naive
schedule benchmarks compare against).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor

from torch import Tensor

from moekit.storage.aligned import READERS


class Transfers:
    """Reads on a pool, writes on one thread, each region's reads after its writes."""

    def __init__(self, overlap: bool = True, name: str = "moekit-io") -> None:
        self.overlap = overlap
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix=f"{name}-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-write")
        self._writes: dict[Hashable, Future[None]] = {}  # region -> its last write
        self._buffer_writes: dict[int, Future[None]] = {}  # id of a buffer -> its last write
        self._reads: list[Future[None]] = []  # reads submitted and perhaps not landed

    def read(
        self, region: Hashable, buf: Tensor, move: Callable[[], object], after: Future | None = None
    ) -> Future[None]:
        """Run ``move`` (a read of ``region`` into ``buf``) on a reader thread, once ``after`` (a read
        that ``move`` completes), the region's last write and the last write out of ``buf`` are done."""
        pending = [after, self._writes.get(region), self._buffer_writes.pop(id(buf), None)]

        def run() -> None:
            for future in pending:
                if future is not None:
                    future.result()
            move()

        future = self._readers.submit(run)
        self._reads = [f for f in self._reads if not f.done()] + [future]
        if not self.overlap:
            future.result()
        return future

    def write(self, region: Hashable, buf: Tensor, move: Callable[[], object]) -> Future[None]:
        """Run ``move`` (a write of ``buf`` to ``region``) on the writer thread, after the writes before it."""
        self.wait_buffer(buf)
        future = self._writer.submit(move)
        self._writes[region] = self._buffer_writes[id(buf)] = future
        if not self.overlap:
            future.result()
        return future

    def wait_buffer(self, buf: Tensor) -> None:
        """Before ``buf`` is overwritten: its last write has left it."""
        pending = self._buffer_writes.pop(id(buf), None)
        if pending is not None:
            pending.result()

    def flush(self) -> None:
        """Every read submitted has landed and every write has reached its tier."""
        for future in [*self._reads, *self._writes.values()]:
            future.result()
        self._reads.clear()
        self._writes.clear()
        self._buffer_writes.clear()

    def close(self) -> None:
        """Cancel the reads not started, finish the rest and every write."""
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
