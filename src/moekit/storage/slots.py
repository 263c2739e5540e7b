"""The fast tier: a fixed set of equal slots under a strict byte budget, and its eviction policies.

The slots are allocated once (``num_slots * slot_bytes`` <= budget), so the resident bytes can never
exceed the budget: a load needs a free slot or evicts an unpinned one. Pins protect what is being
computed with and what was fetched ahead for the next use. Offloaded inference keeps an expert in
each slot, offloaded training a layer's expert weights.

Policies are pluggable (``POLICIES``): ``lru``, ``lfu`` (counts kept across evictions, ties broken
by recency), ``fifo`` (the ring order throughput mode streams layers through), and ``PassOrder``
(the key used last by a pass walking its keys in one direction: training's working set). ``replay``
runs a recorded routing trace through any named policy, or through Belady's optimal policy, offline.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from moekit.storage.aligned import aligned_empty


class Policy(Protocol):
    """Chooses which unpinned resident key to evict."""

    def touch(self, key: Hashable) -> None: ...  # key was used
    def insert(self, key: Hashable) -> None: ...  # key became resident
    def remove(self, key: Hashable) -> None: ...  # key was evicted
    def victim(self, candidates: Iterable[Hashable]) -> Hashable: ...  # one of candidates to evict


class LRU:
    """Evict the least recently used."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def insert(self, key: Hashable) -> None:
        self._order[key] = None

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        allowed = set(candidates)
        return next(k for k in self._order if k in allowed)


class FIFO(LRU):
    """Evict the oldest resident, whatever its use: a ring over the slots."""

    def touch(self, key: Hashable) -> None:
        pass


class LFU:
    """Evict the least frequently used; counts survive eviction (popular experts stay popular)."""

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}
        self._last: dict[Hashable, int] = {}
        self._clock = 0

    def touch(self, key: Hashable) -> None:
        self._clock += 1
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = self._clock

    def insert(self, key: Hashable) -> None:
        self.touch(key)

    def remove(self, key: Hashable) -> None:
        pass

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        return min(candidates, key=lambda k: (self._count.get(k, 0), self._last.get(k, 0)))


class PassOrder:
    """Evict the key a pass needs last: keys are ordered (layers), and a pass walks them up
    (``direction`` > 0: the lowest is needed last, its next use a pass away) or down (the highest)."""

    def __init__(self) -> None:
        self.direction = 1

    def touch(self, key: Hashable) -> None:
        pass

    def insert(self, key: Hashable) -> None:
        pass

    def remove(self, key: Hashable) -> None:
        pass

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        return (min if self.direction > 0 else max)(candidates)  # type: ignore[type-var]


POLICIES = {"lru": LRU, "lfu": LFU, "fifo": FIFO}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"cache policy {name!r}: choose from {', '.join(POLICIES)}")
    return POLICIES[name]()


@dataclass
class Entry:
    slot: int
    pins: int = 0
    loading: Future | None = None  # the load filling the slot (may be kept once done)


@dataclass
class CacheCounters:
    peak_slots: int = 0  # most slots ever occupied at once
    evictions: int = 0


class SlotCache:
    """``num_slots`` slots of ``slot_bytes`` each on ``device``, by key; thread-safe."""

    def __init__(self, num_slots: int, slot_bytes: int, device: torch.device, policy: Policy) -> None:
        assert num_slots >= 1
        self.num_slots, self.slot_bytes, self.device = num_slots, slot_bytes, device
        # NOTE: each slot is a tensor of its own, made once: autograd keeps one version counter for a
        # tensor and all its views, so in one arena a write into one slot (a load landing) would count as
        # a change to the weights a backward saved from another. On the CPU each starts on a 4 KiB
        # boundary so direct reads can land in it.
        if device.type == "cpu":
            self.slots = [aligned_empty(slot_bytes) for _ in range(num_slots)]
        else:
            self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        self.policy = policy
        self.entries: dict[Hashable, Entry] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self.lock = threading.RLock()
        self.counters = CacheCounters()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def resident_bytes(self) -> int:
        return len(self.entries) * self.slot_bytes

    def slot(self, entry: Entry) -> Tensor:
        return self.slots[entry.slot]

    def get(self, key: Hashable) -> Entry | None:
        """The resident entry for key (counted as a use), or None."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.policy.touch(key)
            return entry

    def reserve(self, key: Hashable, pins: int = 1) -> Entry | None:
        """A slot for key, pinned ``pins`` times: a free one, or the policy's unpinned victim; None if all
        are pinned. A victim's load still landing is waited for (outside the lock) before it is returned."""
        landing = None
        with self.lock:
            assert key not in self.entries, key
            if not self._free:
                candidates = [k for k, e in self.entries.items() if e.pins == 0]
                if not candidates:
                    return None
                victim = self.policy.victim(candidates)
                gone = self.entries.pop(victim)
                self._free.append(gone.slot)
                self.policy.remove(victim)
                self.counters.evictions += 1
                landing = gone.loading
            entry = Entry(self._free.pop(), pins=pins)
            self.entries[key] = entry
            self.policy.insert(key)
            occupied = len(self.entries)
            assert occupied <= self.num_slots and self.resident_bytes <= self.capacity_bytes
            self.counters.peak_slots = max(self.counters.peak_slots, occupied)
        if landing is not None:
            wait([landing])  # a load still landing in the slot would overwrite the new one; its result goes with it
        return entry

    def drop(self, key: Hashable) -> None:
        """Forget key (a failed or cancelled load): its slot is free again."""
        with self.lock:
            entry = self.entries.pop(key)
            self.policy.remove(key)
            self._free.append(entry.slot)

    def unpin(self, entry: Entry) -> None:
        with self.lock:
            assert entry.pins > 0
            entry.pins -= 1

    def pin(self, entry: Entry) -> None:
        with self.lock:
            entry.pins += 1

    def clear(self) -> None:
        """Forget every entry (what the slots held is stale); none may be pinned, loads are waited for."""
        with self.lock:
            assert not any(e.pins for e in self.entries.values())
            landing = [e.loading for e in self.entries.values() if e.loading is not None]
            for key in self.entries:
                self.policy.remove(key)
            self.entries.clear()
            self._free = list(range(self.num_slots - 1, -1, -1))
        wait(landing)

    def keep(self, num_slots: int) -> None:
        """Keep the first ``num_slots`` slots and free the others' memory: before anything is loaded."""
        with self.lock:
            if self.entries:
                raise RuntimeError("a slot cache shrinks only before anything is loaded into it")
            assert 1 <= num_slots <= self.num_slots
            del self.slots[num_slots:]
            self.num_slots = num_slots
            self._free = list(range(num_slots - 1, -1, -1))

    def pin_resident(self, key: Hashable) -> Entry | None:
        """Pin key's entry if it is resident, without counting a use (a prediction is not one); else None."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                entry.pins += 1
            return entry


# ---------------------------------------------------------------------------------------------
# Offline replay of a routing trace: the hit rate each policy reaches, and Belady's ceiling.


def replay(trace: Sequence[Sequence[Hashable]], capacity: int, policy: str) -> float:
    """Hit rate of ``policy`` (a name in POLICIES, or ``belady``) over ``trace``.

    ``trace`` is one request per (step, layer): the experts that layer needed in that step. A
    request's own experts are never evicted while it is served, as in the live cache.
    """
    flat = [(i, key) for i, request in enumerate(trace) for key in request]
    next_use = _next_uses([key for _, key in flat]) if policy == "belady" else []
    chooser = None if policy == "belady" else make_policy(policy)
    resident: dict[Hashable, int] = {}  # key -> position of its next use (belady) or 0
    hits = 0
    for pos, (i, key) in enumerate(flat):
        if key in resident:
            hits += 1
            if chooser is not None:
                chooser.touch(key)
        else:
            if len(resident) >= capacity:
                current = set(trace[i])
                candidates = [k for k in resident if k not in current] or list(resident)
                if chooser is None:
                    victim = max(candidates, key=lambda k: resident[k])
                else:
                    victim = chooser.victim(candidates)
                    chooser.remove(victim)
                del resident[victim]
            if chooser is not None:
                chooser.insert(key)
        resident[key] = next_use[pos] if next_use else 0
    return hits / max(1, len(flat))


def _next_uses(keys: list[Hashable]) -> list[int]:
    """For each position, where the same key is next requested (len(keys) if never)."""
    out, seen = [0] * len(keys), {}
    for pos in range(len(keys) - 1, -1, -1):
        out[pos] = seen.get(keys[pos], len(keys))
        seen[keys[pos]] = pos
    return out
