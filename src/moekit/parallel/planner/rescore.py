"""Stage two of the planner (SmartMoE): re-score stage one's candidates with measured expert loads,
with and without load-aware placement (``parallel/placement.py``, the code a live run uses), and say
whether switching pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moekit.parallel.placement import imbalance, place_experts, rank_loads
from moekit.parallel.planner.comm import all_to_all_time
from moekit.parallel.planner.cost import Estimate, estimate
from moekit.parallel.planner.flops import param_counts
from moekit.parallel.planner.presets import Cluster, ModelSpec


@dataclass(frozen=True)
class Rescored:
    estimate: Estimate  # with the measured loads and plain expert parallelism
    placed: Estimate  # with the measured loads after load-aware placement
    switch_s: float  # one re-placement: expert weights and optimizer state moved
    switch: bool  # the time saved over ``remaining_steps`` pays for the re-placement


def layout_imbalance(loads: Sequence[Sequence[float]], ep: int, placed: bool) -> tuple[float, float]:
    """(mean over layers of max/mean rank load, fraction of experts moved) with or without placement."""
    if ep == 1:
        return 1.0, 0.0
    factors, moved = [], []
    for layer in loads:
        if placed:
            p = place_experts(layer, ep)
            factors.append(p.after)
            moved.append(p.moves / len(layer))
        else:
            factors.append(imbalance(rank_loads(layer, tuple(range(len(layer))), ep)))
    return sum(factors) / len(factors), (sum(moved) / len(moved) if moved else 0.0)


def rescore(
    spec: ModelSpec, c: Cluster, rows: list[Estimate], loads: Sequence[Sequence[float]], remaining_steps: int
) -> list[Rescored]:
    """Stage two: re-score stage one's candidates with measured per-layer expert loads."""
    _, expert_p = param_counts(spec)
    out = []
    for row in rows:
        cand = row.candidate
        plain_f, _ = layout_imbalance(loads, cand.ep, placed=False)
        placed_f, moved = layout_imbalance(loads, cand.ep, placed=True)
        plain, placed = estimate(spec, cand, c, plain_f), estimate(spec, cand, c, placed_f)
        nbytes = moved * expert_p / (cand.pp * cand.dp * cand.cp * cand.etp) * (spec.workload.state_bytes - 4)
        switch_s = all_to_all_time(nbytes, cand.ep, cand.tp, c)
        switch = (plain.step_s - placed.step_s) * remaining_steps > switch_s
        out.append(Rescored(plain, placed, switch_s, switch))
    return sorted(out, key=lambda r: min(r.estimate.step_s, r.placed.step_s))
