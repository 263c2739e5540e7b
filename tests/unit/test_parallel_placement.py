"""Expert placement and shadow-expert choice: pure functions over loads."""

from __future__ import annotations

import random

import pytest

from moekit.parallel.placement import (
    choose_shadows,
    imbalance,
    migration,
    place_experts,
    rank_loads,
)

IDENTITY = tuple(range(8))  # expert e in slot e


def _zipf(n: int, s: float = 1.2, shift: int = 0) -> list[float]:
    return [1000.0 / ((i - shift) % n + 1) ** s for i in range(n)]


@pytest.mark.parametrize("experts,ranks", [(8, 4), (16, 4), (12, 3), (64, 8)])
def test_placement_respects_slots_and_cuts_max_load(experts: int, ranks: int) -> None:
    rng = random.Random(experts)
    for trial in range(5):
        loads = _zipf(experts, 1.0 + trial * 0.2, shift=rng.randrange(experts))
        rng.shuffle(loads)
        p = place_experts(loads, ranks)
        assert sorted(p.expert_to_slot) == list(range(experts)), "a permutation of the slots"
        per_rank = [0] * ranks
        for s in p.expert_to_slot:
            per_rank[s // (experts // ranks)] += 1
        assert per_rank == [experts // ranks] * ranks, "each rank exactly its slots"
        assert p.after <= p.before + 1e-12
        assert p.after == pytest.approx(imbalance(rank_loads(loads, p.expert_to_slot, ranks)))


def test_placement_on_a_skewed_layer() -> None:
    """Hand-checked: the two heavy experts of rank 0 are split, one swapped with a light one."""
    loads = [40.0, 30.0, 10.0, 10.0, 5.0, 5.0, 0.0, 0.0]  # identity: ranks 70, 20, 10, 0 -> max/mean 2.8
    p = place_experts(loads, 4)
    assert p.before == pytest.approx(2.8)
    assert max(rank_loads(loads, p.expert_to_slot, 4)) == pytest.approx(40.0)  # the heaviest expert alone
    assert p.gain == pytest.approx(1 - 40 / 70)


def test_bounded_moves() -> None:
    loads = [1000.0 / (i + 1) ** 0.5 for i in range(16)]
    random.Random(0).shuffle(loads)
    free = place_experts(loads, 4)
    bounded = place_experts(loads, 4, max_moves=2)
    assert bounded.moves <= 2 < free.moves
    assert free.after <= bounded.after < bounded.before


def test_balanced_loads_stay_put_and_bad_input_is_named() -> None:
    p = place_experts([5.0] * 8, 4, current=(3, 2, 1, 0, 4, 5, 6, 7))
    assert p.moves == 0 and p.after == pytest.approx(1.0)
    with pytest.raises(ValueError, match="3 ranks must divide 8"):
        place_experts([1.0] * 8, 3)
    with pytest.raises(ValueError, match="not a permutation"):
        place_experts([1.0] * 4, 2, current=(0, 0, 1, 2))


def test_migration_moves_every_row_to_its_new_slot() -> None:
    """Simulate the all-to-all of ``migration`` on lists: every rank ends with its new slots' experts."""
    old, new, ranks = IDENTITY, place_experts(_zipf(8), 4).expert_to_slot, 4
    El = 2
    held = {r: [e for e in sorted(range(8), key=lambda e: old[e]) if old[e] // El == r] for r in range(ranks)}
    outboxes = {}
    for r in range(ranks):
        rows, splits, _, _ = migration(old, new, ranks, r)
        payload = [held[r][i] for i in rows]
        outboxes[r] = [payload[sum(splits[:d]) : sum(splits[: d + 1])] for d in range(ranks)]
    for r in range(ranks):
        _, _, recv_splits, recv_slots = migration(old, new, ranks, r)
        arrived = [e for s in range(ranks) for e in outboxes[s][r]]
        assert [len(outboxes[s][r]) for s in range(ranks)] == recv_splits
        placed = [None] * El
        for e, slot in zip(arrived, recv_slots, strict=True):
            placed[slot] = e
        assert all(new[e] == r * El + i for i, e in enumerate(placed))


def test_shadow_cost_model_hand_computed() -> None:
    # 4 ranks, expert 0 takes 400 of 1000 rows. Tokens of 100 bytes, experts of 1000 bytes.
    loads = [400.0] + [600.0 / 7] * 7
    choice = choose_shadows(loads, IDENTITY, 4, token_bytes=100.0, expert_bytes=1000.0, max_shadows=1)
    assert choice.experts == (0,)
    assert choice.bytes_saved == pytest.approx(4 * 100 * 400 * 3 / 4 / 4)  # 30000
    assert choice.bytes_moved == pytest.approx(1000 * (1 + 2 * 3 / 4))  # 2500
    assert choice.after < imbalance(rank_loads(loads, IDENTITY, 4))
    # A second shadow: expert 2 (saves 4 * 100 * 85.7 * 3 / 16 = 6429 > 2500), as rank 1 stays above the mean.
    assert choose_shadows(loads, IDENTITY, 4, 100.0, 1000.0, 2).experts == (0, 2)
    # Heavy weights make replication a loss: nothing is shadowed.
    assert choose_shadows(loads, IDENTITY, 4, 100.0, 1e6, 2).experts == ()
