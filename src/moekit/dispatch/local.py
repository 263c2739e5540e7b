"""Single-device dispatch: sort assignments by expert, gather, and scatter back weighted.

Legend: T tokens, D model dim, E experts, R assignments kept after any capacity drop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.routing import RouterOutput


@dataclass(frozen=True)
class DispatchMeta:
    """Everything combine needs, handed from dispatch to combine (no state on the module)."""

    token_idx: Tensor  # [R] token each sorted row came from
    weights: Tensor  # [R] combine weight of each sorted row
    num_tokens: int  # T
    tokens_per_expert: Tensor  # [E] rows each expert received, after any capacity drop
    routed_per_expert: Tensor  # [E] assignments each expert was routed, before any capacity drop


class LocalDispatcher:
    """Dropless (MegaBlocks) or capacity-limited (Switch/GShard) dispatch on one device."""

    def __init__(self, num_experts: int, capacity_factor: float | None = None) -> None:
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor

    def capacity(self, num_assignments: int) -> int:
        """Rows each expert may keep: ``ceil(capacity_factor * R / E)``."""
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * num_assignments / self.num_experts)

    def dispatch(self, x_TD: Tensor, routing: RouterOutput, keys: Tensor | None = None) -> tuple[Tensor, DispatchMeta]:
        """Rows of ``x`` grouped by expert: returns x_sorted [R, D] and the meta for combine.

        ``keys`` (one distinct integer per expert) orders the groups by key instead of by expert id;
        the meta's counts are then per key (``max(keys) + 1`` of them).
        """
        expert_idx = routing.expert_idx if keys is None else keys[routing.expert_idx]
        groups = self.num_experts if keys is None else int(keys.max()) + 1
        # NOTE: the sort is stable so rows keep the router's k-major order inside each expert;
        # that order is GShard's priority for capacity drops and makes results reproducible.
        expert_sorted, order = torch.sort(expert_idx, stable=True)
        routed = torch.bincount(expert_idx, minlength=groups)
        if self.capacity_factor is not None:
            starts = torch.cumsum(routed, dim=0) - routed
            position = torch.arange(order.numel(), device=order.device) - starts[expert_sorted]
            keep = position < self.capacity(routing.num_picks)
            order, expert_sorted = order[keep], expert_sorted[keep]
            kept = torch.bincount(expert_sorted, minlength=groups)
        else:
            kept = routed
        token_idx = routing.token_idx[order]
        meta = DispatchMeta(token_idx, routing.weights[order], routing.num_tokens, kept, routed)
        return x_TD.index_select(0, token_idx), meta

    def apply(self, x_TD: Tensor, routing: RouterOutput, experts) -> tuple[Tensor, DispatchMeta]:
        """dispatch -> experts -> combine: the one call the MoE layer makes on any dispatcher."""
        x_sorted, meta = self.dispatch(x_TD, routing)
        return self.combine(experts(x_sorted, meta.tokens_per_expert), meta), meta

    @staticmethod
    def combine(y_sorted_RD: Tensor, meta: DispatchMeta) -> Tensor:
        """Weighted sum of each token's expert outputs: y[t] = sum_r w_r * y_sorted[r] (r of t)."""
        if meta.num_tokens == 1:
            return LocalDispatcher.combine_one_token(y_sorted_RD, meta.weights)
        weighted = y_sorted_RD * meta.weights.unsqueeze(1).to(y_sorted_RD.dtype)
        out = y_sorted_RD.new_zeros(meta.num_tokens, y_sorted_RD.shape[1])
        return out.index_add_(0, meta.token_idx, weighted)

    @staticmethod
    def combine_one_token(y_sorted_KD: Tensor, weights_K: Tensor) -> Tensor:
        """``combine`` of a single token, whose rows (in the dispatcher's order) are all its own: ``[1, D]``.

        NOTE: a sum, not index_add_, whose kernel enters a parallel region whatever its size, which a busy
        machine's descheduled thread stalls."""
        return (y_sorted_KD * weights_K.unsqueeze(1).to(y_sorted_KD.dtype)).sum(0, keepdim=True)
