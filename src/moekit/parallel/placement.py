"""Load-aware expert placement and shadow experts: pure functions over loads (no process group).

Legend: E experts of a layer, W ranks of the ep group, El = E / W slots per rank.

Every ep rank has El slots; slot s lives on rank ``s // El``. A placement is a permutation
``expert_to_slot`` (expert e runs in slot ``expert_to_slot[e]``); plain expert parallelism is the
identity. Placement (SmartMoE) changes where experts run, never what they compute: the runtime
(``parallel/rebalance.py``) moves weights and optimizer state to follow it. Shadow experts
(FasterMoE) replicate the most popular experts on every rank for a while, so their tokens are
computed where they are instead of sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def rank_loads(
    loads: Sequence[float], expert_to_slot: Sequence[int], ranks: int, shadows: Sequence[int] = ()
) -> list[float]:
    """Rows each rank computes: its experts' loads, with a shadow expert's load spread evenly."""
    per_rank = len(expert_to_slot) // ranks
    out = [0.0] * ranks
    shadowed = set(shadows)
    for e, load in enumerate(loads):
        if e in shadowed:
            for r in range(ranks):
                out[r] += load / ranks
        else:
            out[expert_to_slot[e] // per_rank] += load
    return out


def imbalance(per_rank: Sequence[float]) -> float:
    """max / mean of the ranks' loads (1.0 is perfect balance; no load counts as balanced)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class PlacementProposal:
    """A proposed expert -> slot permutation and what it is predicted to do (the live one is
    ``dispatch.all_to_all.ExpertPlacement``)."""

    expert_to_slot: tuple[int, ...]
    before: float  # max/mean rank load of the current placement
    after: float  # max/mean rank load of this one
    moves: int  # experts that change rank

    @property
    def gain(self) -> float:
        """Predicted relative drop of the most-loaded rank's load (0.25: a quarter less)."""
        return 1.0 - self.after / self.before


def place_experts(
    loads: Sequence[float], ranks: int, current: Sequence[int] | None = None, max_moves: int = 0
) -> PlacementProposal:
    """Minimise the most-loaded rank: LPT bin packing with El slots per rank, moving at most ``max_moves``
    experts (0 = no bound).

    The LPT solution is relabelled to keep as many experts on their current rank as possible; if it
    still moves too many experts, pairwise swaps from the current placement (each moving two) are used
    instead, best swap first, within the bound.
    """
    E = len(loads)
    if ranks <= 0 or E % ranks:
        raise ValueError(f"place_experts: {ranks} ranks must divide {E} experts")
    current = tuple(current) if current is not None else tuple(range(E))
    if sorted(current) != list(range(E)):
        raise ValueError(f"place_experts: current={current} is not a permutation of {E} slots")
    El = E // ranks
    before = imbalance(rank_loads(loads, current, ranks))
    lpt = _relabel(_lpt(loads, ranks), current, El)
    candidates = [_swaps(loads, current, ranks, max_moves // 2 if max_moves else E)]
    if not max_moves or _moves(current, lpt, El) <= max_moves:
        candidates.append(lpt)
    best = min(candidates, key=lambda slots: (max(rank_loads(loads, slots, ranks)), _moves(current, slots, El)))
    return PlacementProposal(best, before, imbalance(rank_loads(loads, best, ranks)), _moves(current, best, El))


def _lpt(loads: Sequence[float], ranks: int) -> list[int]:
    """Longest processing time first: heaviest expert to the least-loaded rank with a free slot."""
    El = len(loads) // ranks
    total, used = [0.0] * ranks, [0] * ranks
    rank_of = [0] * len(loads)
    for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        r = min((r for r in range(ranks) if used[r] < El), key=lambda r: (total[r], r))
        rank_of[e] = r
        total[r] += loads[e]
        used[r] += 1
    return rank_of


def _relabel(rank_of: list[int], current: Sequence[int], El: int) -> tuple[int, ...]:
    """Slots for an expert -> rank assignment: new ranks renamed (greedily, by overlap) to the current
    ranks they share most experts with; experts staying on their rank keep their slot."""
    ranks = len(current) // El
    overlap = [[0] * ranks for _ in range(ranks)]
    for e, r in enumerate(rank_of):
        overlap[r][current[e] // El] += 1
    pairs = sorted((-overlap[a][b], a, b) for a in range(ranks) for b in range(ranks))
    name, taken = {}, set()
    for _, a, b in pairs:
        if a not in name and b not in taken:
            name[a] = b
            taken.add(b)
    target = [name[r] for r in rank_of]
    return _slots_for(target, current, El)


def _slots_for(target_rank: Sequence[int], current: Sequence[int], El: int) -> tuple[int, ...]:
    """Experts that stay on their rank keep their slot; the others fill the freed slots in order."""
    slots = [-1] * len(current)
    free = {r: [] for r in range(len(current) // El)}
    for e, r in enumerate(target_rank):
        if current[e] // El == r:
            slots[e] = current[e]
    used = set(s for s in slots if s >= 0)
    for s in range(len(current)):
        if s not in used:
            free[s // El].append(s)
    for e, r in enumerate(target_rank):
        if slots[e] < 0:
            slots[e] = free[r].pop(0)
    return tuple(slots)


def _swaps(loads: Sequence[float], current: Sequence[int], ranks: int, max_swaps: int) -> tuple[int, ...]:
    """Greedy local search: swap an expert of the most-loaded rank with one elsewhere while that lowers
    the pair's maximum, at most ``max_swaps`` times."""
    slots = list(current)
    El = len(slots) // ranks
    for _ in range(max_swaps):
        per_rank = rank_loads(loads, slots, ranks)
        top = max(range(ranks), key=lambda r: (per_rank[r], -r))
        best, best_pair = per_rank[top], None
        for a in (e for e in range(len(slots)) if slots[e] // El == top):
            for b in (e for e in range(len(slots)) if slots[e] // El != top):
                other = slots[b] // El
                delta = loads[a] - loads[b]
                worst = max(per_rank[top] - delta, per_rank[other] + delta)
                if worst < best - 1e-12:
                    best, best_pair = worst, (a, b)
        if best_pair is None:
            break
        a, b = best_pair
        slots[a], slots[b] = slots[b], slots[a]
    return tuple(slots)


def _moves(current: Sequence[int], slots: Sequence[int], El: int) -> int:
    return sum(c // El != s // El for c, s in zip(current, slots, strict=True))


@dataclass(frozen=True)
class ShadowChoice:
    """Experts to replicate on every rank, and the cost model's figures per step (bytes per rank)."""

    experts: tuple[int, ...]
    bytes_saved: float  # token rows not sent (dispatch + combine, forward + backward)
    bytes_moved: float  # weights broadcast to every rank + gradients all-reduced
    after: float  # max/mean rank load with these shadows


def choose_shadows(
    loads: Sequence[float],
    expert_to_slot: Sequence[int],
    ranks: int,
    token_bytes: float,
    expert_bytes: float,
    max_shadows: int,
) -> ShadowChoice:
    """FasterMoE's choice: shadow the most popular experts while each pays for itself.

    ``loads`` are one step's rows per expert over the whole ep group. Shadowing expert e keeps the
    ``load_e (W - 1) / W`` rows that would cross ranks at home, in both directions and both passes:
    ``4 token_bytes`` each, spread over W ranks. It costs a broadcast of its weights (``expert_bytes``
    to each rank) and a ring all-reduce of its gradient (``2 (W - 1) / W expert_bytes`` per rank).
    An expert is taken, most popular first, while its saving exceeds its cost and it is on a rank more
    loaded than the mean (replicating an expert of an idle rank does not shorten the step).
    """
    chosen: list[int] = []
    saved = moved = 0.0
    W = ranks
    cost = expert_bytes * (1 + 2 * (W - 1) / W)
    for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        if len(chosen) >= max_shadows or W == 1:
            break
        gain = 4 * token_bytes * loads[e] * (W - 1) / W / W
        per_rank = rank_loads(loads, expert_to_slot, ranks, chosen)
        owner = expert_to_slot[e] // (len(loads) // ranks)
        if gain <= cost or per_rank[owner] <= sum(per_rank) / W:
            continue
        chosen.append(e)
        saved += gain
        moved += cost
    after = imbalance(rank_loads(loads, expert_to_slot, ranks, chosen))
    return ShadowChoice(tuple(sorted(chosen)), saved, moved, after)


def migration(
    old: Sequence[int], new: Sequence[int], ranks: int, rank: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """How rank ``rank`` moves its slot rows from placement ``old`` to ``new`` in one all-to-all.

    Returns (send_rows, send_splits, recv_splits, recv_slots): the local rows (old slots - rank*El)
    to send, grouped by destination rank; rows per destination; rows per source; and the local slot
    each received row lands in, in the order they arrive (by source, then by new slot).
    """
    El = len(old) // ranks
    mine = sorted((e for e in range(len(old)) if old[e] // El == rank), key=lambda e: new[e])
    send_rows = [old[e] - rank * El for e in mine]
    send_splits = [sum(1 for e in mine if new[e] // El == d) for d in range(ranks)]
    arriving = sorted((e for e in range(len(old)) if new[e] // El == rank), key=lambda e: (old[e] // El, new[e]))
    recv_splits = [sum(1 for e in arriving if old[e] // El == s) for s in range(ranks)]
    recv_slots = [new[e] - rank * El for e in arriving]
    return send_rows, send_splits, recv_splits, recv_slots
