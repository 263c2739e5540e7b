"""Eviction policies and offline replay: hand-checked hit counts; Belady's optimum bounds every policy."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future

import pytest
import torch

from moekit.storage.slots import PassOrder, SlotCache, make_policy, replay

TRACE = [["a", "b"], ["c"], ["a"], ["d"], ["a", "b"], ["c"]]


def test_replay_matches_hand_counts() -> None:
    # capacity 2, 8 requests: LRU and LFU both evict a before its reuse at position 3 and hit once
    # (a at position 5); Belady evicts b there instead (b's next use is farther) and hits twice.
    assert replay(TRACE, 2, "lru") == pytest.approx(1 / 8)
    assert replay(TRACE, 2, "lfu") == pytest.approx(1 / 8)
    assert replay(TRACE, 2, "belady") == pytest.approx(2 / 8)
    # a used twice before b and c: LFU keeps it through them, LRU evicts it.
    popular = [["a"], ["a"], ["b"], ["c"], ["a"]]
    assert replay(popular, 2, "lru") == pytest.approx(1 / 5)
    assert replay(popular, 2, "lfu") == pytest.approx(2 / 5) == replay(popular, 2, "belady")


def test_belady_bounds_every_policy_on_skewed_traces() -> None:
    rng = random.Random(0)
    for _ in range(20):
        trace = [rng.choices(range(12), weights=[1 / (i + 1) for i in range(12)], k=3) for _ in range(60)]
        trace = [sorted(set(r)) for r in trace]
        best = replay(trace, 4, "belady")
        for policy in ("lru", "lfu", "fifo"):
            assert replay(trace, 4, policy) <= best + 1e-12


def test_cache_never_exceeds_its_slots_and_respects_pins() -> None:
    cache = SlotCache(2, 64, torch.device("cpu"), make_policy("lru"))
    a = cache.reserve("a")
    b = cache.reserve("b")
    assert cache.reserve("c") is None  # both pinned: no slot, rather than exceed the budget
    cache.unpin(a)
    c = cache.reserve("c")  # evicts a, the only unpinned one
    assert c is not None and "a" not in cache.entries and cache.resident_bytes == 128 == cache.capacity_bytes
    cache.unpin(b)
    cache.unpin(c)
    cache.get("b")
    cache.reserve("d")
    assert set(cache.entries) == {"b", "d"}  # c was least recently used
    assert cache.counters.peak_slots == 2 and cache.counters.evictions == 2


def test_pin_resident_keeps_a_key_without_counting_a_use() -> None:
    cache = SlotCache(2, 64, torch.device("cpu"), make_policy("lru"))
    for key in ("a", "b"):
        cache.unpin(cache.reserve(key))
    assert cache.pin_resident("c") is None  # not resident: nothing pinned
    a = cache.pin_resident("a")  # a is the least recently used, and stays so ...
    assert a is not None and a.pins == 1
    cache.reserve("c")  # ... yet it is kept: b goes
    assert set(cache.entries) == {"a", "c"}
    cache.unpin(a)
    cache.unpin(cache.entries["c"])
    cache.reserve("d")  # the pin did not count as a use: a, least recently used, goes
    assert set(cache.entries) == {"c", "d"}


def test_pass_order_evicts_the_layer_a_pass_needs_last_and_waits_for_its_load() -> None:
    """Training's working set: walking up, the lowest unpinned layer goes (its next use is a pass away);
    walking down, the highest. A victim whose load is still landing is waited for before its slot is
    handed on, so the load cannot write over the new key's bytes."""
    order = PassOrder()
    cache = SlotCache(3, 64, torch.device("cpu"), order)
    for layer in (2, 0, 1):
        cache.reserve(layer, pins=0)
    order.direction = +1
    cache.reserve(3, pins=0)
    assert set(cache.entries) == {1, 2, 3}
    order.direction = -1
    landing: Future[None] = Future()
    cache.entries[3].loading = landing
    done = threading.Timer(0.2, landing.set_result, (None,))
    done.start()
    cache.reserve(0, pins=0)  # evicts layer 3, the highest, once its load has landed
    assert landing.done() and set(cache.entries) == {0, 1, 2}
    cache.clear()
    assert not cache.entries and cache.reserve(7) is not None
