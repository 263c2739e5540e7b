"""How a key's bytes reach its fast-tier slot: one loader per kind of device, picked once.

The user of a ``SlotCache`` (offloaded inference's ``Offloader``) decides which key goes into which
slot and when; a loader moves the bytes from a ``Source`` and orders each move against the
computations that read the slot. One load, as the offloader drives it::

    future = loader.load(key, entry, done)  # start the transfer; done() runs once it is in
    future.result()                         # before the expert is computed (raises a failed load)
    loader.before_compute(entry)            # the transfer must have landed
    ...                                     # the expert's matmuls read the slot
    loader.after_compute(entry)             # a later transfer into the slot must wait for them

- ``FileLoader`` (CPU): the slot is host memory. Each load reads the key's byte ranges from the
  source's files straight into it, on the reader threads of ``Transfers`` while what is resident
  computes. The host waits for a read before computing and computes before the slot can be read
  into again, so there is nothing more to order.
- ``CudaLoader`` (GPU): the slot is device memory and the slow tier a page-locked ``HostTier``
  holding every key (filled from the source once). Each load queues a DMA copy on a side CUDA stream
  and returns; the copy records an event the compute stream waits for before using the slot, and
  each computation records an event the next copy into that slot waits for, so transfers overlap
  compute without synchronising the device. Its tests run where a GPU is (``.ci/cuda``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from typing import Protocol

import torch

from moekit.errors import OptionError
from moekit.storage.host import HostTier
from moekit.storage.slots import Entry, SlotCache
from moekit.storage.transfers import Transfers


class Source(Protocol):
    """A slow tier read a key at a time into a slot (offloaded inference's expert stores)."""

    slot_bytes: int  # room one key takes in a slot
    pieces: Iterable[Hashable]  # every key it holds

    def read_into(self, key: Hashable, slot_U8: torch.Tensor) -> int:
        """Read ``key`` into a CPU slot of ``slot_bytes``; the bytes read."""
        ...


class Loader(Protocol):
    """Moves keys from the slow tier into the cache's slots, ordered against their computations."""

    def load(self, key: Hashable, entry: Entry, done: Callable[[], None]) -> Future[None]:
        """Start moving ``key`` into ``entry``'s slot. ``done`` runs once the expert may be
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
    """CPU: keys read from the source's files into host slots by reader threads."""

    def __init__(self, source: Source, cache: SlotCache) -> None:
        self.source, self.cache = source, cache
        self._io = Transfers(name="moekit-load")

    def load(self, key: Hashable, entry: Entry, done: Callable[[], None]) -> Future[None]:
        slot = self.cache.slot(entry)
        return self._io.read(key, slot, lambda: (self.source.read_into(key, slot), done()))

    def before_compute(self, entry: Entry) -> None:
        pass  # the read is done: the caller waited for its future

    def after_compute(self, entry: Entry) -> None:
        pass  # the computation ran on the host before the slot could be handed to another read

    def close(self) -> None:
        self._io.close()


def pinned_tier(source: Source, pin: bool = True) -> HostTier:
    """The slow tier on a GPU: every key of ``source`` in page-locked host memory, read once."""
    return HostTier(list(source.pieces), source.slot_bytes, source.read_into, pin=pin)


class CudaLoader:
    """GPU: keys copied from pinned host memory into device slots on a side stream, ordered by events."""

    def __init__(self, source: Source, cache: SlotCache) -> None:
        self.cache = cache
        self.device = cache.device
        self.host = pinned_tier(source)
        self._copies = torch.cuda.Stream(self.device)
        self._copied: list[torch.cuda.Event | None] = [None] * cache.num_slots  # each slot's last copy
        self._released: list[torch.cuda.Event | None] = [None] * cache.num_slots  # its last computation

    def load(self, key: Hashable, entry: Entry, done: Callable[[], None]) -> Future[None]:
        """Queue the copy and return a finished future: the events order the rest on the device."""
        future: Future[None] = Future()
        try:
            with torch.cuda.stream(self._copies):
                released = self._released[entry.slot]
                if released is not None:  # the slot's previous expert may still be computing
                    self._copies.wait_event(released)
                self.cache.slot(entry).copy_(self.host.get(key), non_blocking=True)
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
        self._copies.synchronize()  # no copy may still write into a slot once it is freed


def make_loader(source: Source, cache: SlotCache) -> Loader:
    """The loader for the device the cache's slots live on."""
    device = cache.device
    if device.type == "cuda":
        return CudaLoader(source, cache)
    if device.type == "cpu":
        return FileLoader(source, cache)
    raise OptionError("device", "offloaded experts run on cpu or cuda", device)
