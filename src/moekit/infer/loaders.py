"""How an expert's weights reach its fast-tier slot: one loader per kind of device, picked once.

The ``Offloader`` decides which expert goes into which slot and when; a loader moves the bytes and
orders each move against the computations that read the slot. One load, as the offloader drives it::

    future = loader.load(key, entry, done)  # start the transfer; done() runs once it is in
    future.result()                         # before the expert is computed (raises a failed load)
    loader.before_compute(entry)            # the transfer must have landed
    ...                                     # the expert's matmuls read the slot
    loader.after_compute(entry)             # a later transfer into the slot must wait for them

- ``FileLoader`` (CPU): the slot is host memory. Each load reads the expert's byte ranges from the
  store's file straight into it, on a pool of ``READERS`` threads (a deeper disk queue than one)
  while the resident experts compute. The host waits for a read before computing and computes
  before the slot can be read into again, so there is nothing more to order.
- ``CudaLoader`` (GPU): the slot is device memory and the slow tier page-locked host memory
  (``PinnedExperts``, filled from the file once). Each load queues a DMA copy on a side CUDA stream
  and returns; the copy records an event the compute stream waits for before using the slot, and
  each computation records an event the next copy into that slot waits for, so transfers overlap
  compute without synchronising the device. Its tests run where a GPU is (``.ci/cuda``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import Tensor

from moekit.directio import READERS, aligned_empty
from moekit.infer.cache import Entry, ExpertCache
from moekit.infer.expert_store import ExpertStore, Key


class ExpertLoader(Protocol):
    """Moves experts from the slow tier into the cache's slots, ordered against their computations."""

    def load(self, key: Key, entry: Entry, done: Callable[[], None]) -> Future[None]:
        """Start moving expert ``key`` into ``entry``'s slot. ``done`` runs once the expert may be
        treated as loaded, before the future completes; the future holds a failed load's error and
        can be cancelled until the load starts."""
        ...

    def before_compute(self, entry: Entry) -> None:
        """Make the computation about to read ``entry``'s slot wait for the transfer into it."""
        ...

    def after_compute(self, entry: Entry) -> None:
        """Make the next transfer into ``entry``'s slot wait for the computation just issued."""
        ...

    def close(self) -> None:
        """Finish or cancel the loads in flight."""
        ...


class FileLoader:
    """CPU: experts read from the store's file into host slots by a pool of reader threads."""

    def __init__(self, store: ExpertStore, cache: ExpertCache) -> None:
        self.store, self.cache = store, cache
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="moekit-read")

    def load(self, key: Key, entry: Entry, done: Callable[[], None]) -> Future[None]:
        return self._readers.submit(self._read, key, entry, done)

    def _read(self, key: Key, entry: Entry, done: Callable[[], None]) -> None:
        self.store.read_into(key, self.cache.slot(entry))
        done()

    def before_compute(self, entry: Entry) -> None:
        pass  # the read is done: the caller waited for its future

    def after_compute(self, entry: Entry) -> None:
        pass  # the computation ran on the host before the slot could be handed to another read

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)


class PinnedExperts:
    """The slow tier on a GPU: every expert of the store in page-locked host memory, read once.

    Page-locked memory is what lets the device copy asynchronously (DMA); pageable memory would
    make each copy synchronous and staged by the driver.
    """

    def __init__(self, store: ExpertStore, pin: bool = True) -> None:
        self.index = {key: i for i, key in enumerate(store.pieces)}
        self.host = aligned_empty(len(self.index) * store.slot_bytes, pin=pin).view(len(self.index), store.slot_bytes)
        for key, i in self.index.items():
            store.read_into(key, self.host[i])

    def slot(self, key: Key) -> Tensor:
        return self.host[self.index[key]]


class CudaLoader:
    """GPU: experts copied from pinned host memory into device slots on a side stream, ordered by events."""

    def __init__(self, store: ExpertStore, cache: ExpertCache) -> None:
        self.cache = cache
        self.device = cache.arena.device
        self.host = PinnedExperts(store)
        self._copies = torch.cuda.Stream(self.device)
        self._copied: list[torch.cuda.Event | None] = [None] * cache.num_slots  # each slot's last copy
        self._released: list[torch.cuda.Event | None] = [None] * cache.num_slots  # its last computation

    def load(self, key: Key, entry: Entry, done: Callable[[], None]) -> Future[None]:
        """Queue the copy and return a finished future: the events order the rest on the device."""
        future: Future[None] = Future()
        try:
            with torch.cuda.stream(self._copies):
                released = self._released[entry.slot]
                if released is not None:  # the slot's previous expert may still be computing
                    self._copies.wait_event(released)
                self.cache.slot(entry).copy_(self.host.slot(key), non_blocking=True)
                self._copied[entry.slot] = self._copies.record_event()
            done()
        except BaseException as err:  # reported where the offloader waits for the load, as a read's error is
            future.set_exception(err)
        else:
            future.set_result(None)
        return future

    def before_compute(self, entry: Entry) -> None:
        copied = self._copied[entry.slot]
        if copied is not None:
            torch.cuda.current_stream(self.device).wait_event(copied)

    def after_compute(self, entry: Entry) -> None:
        # NOTE: recorded before the offloader unpins the slot, which is what lets a copy reuse it.
        self._released[entry.slot] = torch.cuda.current_stream(self.device).record_event()

    def close(self) -> None:
        self._copies.synchronize()  # no copy may still write into the arena once it is freed


def make_loader(store: ExpertStore, cache: ExpertCache) -> ExpertLoader:
    """The loader for the device the cache's slots live on."""
    device = cache.arena.device
    if device.type == "cuda":
        return CudaLoader(store, cache)
    if device.type == "cpu":
        return FileLoader(store, cache)
    raise ValueError(f"device={device}: offloaded experts run on cpu or cuda")
