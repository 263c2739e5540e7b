"""Deduplicated expert-parallel dispatch: a token travels once to each ep rank holding any of its experts.

Legend: T tokens, D model dim, E experts (global), El experts per rank, W ranks in the ep group,
R assignments (token, expert), P (token, rank) pairs this rank sends, Q pairs it receives,
K slots per pair (the most experts one token picks on one rank, over the ep group), A assignments
a rank computes.

``AllToAllDispatcher`` sends one row per assignment, k rows per token. Here (DeepSeek-V3's
node-limited dispatch, as DeepEP does it) one row goes per (token, rank) pair, carrying the
token's local expert ids and gate weights; the receiving rank expands it to its experts (a local
permute), runs the grouped GEMM, sums the weighted outputs per pair and sends one row back; the
sender sums its pairs per token:
    pairs by rank -> exchange counts -> all-to-all [x | w] and ids -> expand, GEMM, sum per pair
    -> all-to-all back -> sum per token
With group-limited routing and groups mapped to ranks (``n_group`` a multiple of ep), a token
reaches at most ``topk_group`` ranks, so it sends at most that many rows instead of k.
The exchanges are ``all_to_all.exchange``'s (flat or two-level, differentiable), so the gate
weights travel with the rows and get their gradient back through the reverse exchange.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from moekit.dispatch.all_to_all import EPGroups, Exchange, ExpertPlacement, exchange
from moekit.dispatch.base import ScheduledExperts
from moekit.dispatch.local import DispatchMeta
from moekit.experts.grouped import ExpertsFn
from moekit.routing import RouterOutput


class DedupDispatcher:
    """Dropless dispatch that sends one row per (token, destination rank), not per (token, expert).

    Experts run at their home rank (``expert // El``): no re-placement, no shadows, no capacity and
    no overlap chunks (``parallel.mesh.resolve_layout`` refuses those combinations).
    """

    def __init__(self, num_experts: int, groups: EPGroups) -> None:
        self.world = dist.get_world_size(groups.ep)
        assert num_experts % self.world == 0, "ep must divide num_experts (checked by the layout)"
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.rank = dist.get_rank(groups.ep)
        self.groups = groups
        self.placement = ExpertPlacement.identity(num_experts)  # fixed; read by the rebalancer's load metrics

    def apply(self, x_TD: Tensor, routing: RouterOutput, experts: ScheduledExperts) -> tuple[Tensor, DispatchMeta]:
        """y [T, D] = sum over each token's assignments of weight x expert(x), one row per (token, rank) each way."""
        T, D = x_TD.shape
        rank_R = routing.expert_idx // self.local_experts
        # NOTE: sorted unique keys order the pairs by destination rank (the exchange's contract), then token.
        keys_P, pair_R = torch.unique(rank_R * T + routing.token_idx, sorted=True, return_inverse=True)
        token_P = keys_P % max(T, 1)
        P = keys_P.numel()
        slot_R = _slot_in_pair(pair_R, P)
        plan, K = self._plan(torch.bincount(keys_P // max(T, 1), minlength=self.world), slot_R)
        ids_PK = torch.full((P, K), -1, dtype=torch.int32, device=x_TD.device)
        ids_PK[pair_R, slot_R] = (routing.expert_idx % self.local_experts).to(torch.int32)
        w_PK = routing.weights.new_zeros(P, K).index_put((pair_R, slot_R), routing.weights)
        payload = torch.cat([x_TD.index_select(0, token_P), w_PK.to(x_TD.dtype)], dim=1)
        y_PD = experts(payload, schedule=functools.partial(self._remote, plan, ids_PK, D))
        y_TD = y_PD.new_zeros(T, D).index_add(0, token_P, y_PD)
        routed = torch.bincount(routing.expert_idx, minlength=self.num_experts)  # dropless: kept = routed
        # NOTE: rows are not sorted here, so the meta carries the router's order; the layer reads only its counts.
        return y_TD, DispatchMeta(routing.token_idx, routing.weights, T, routed, routed)

    def _plan(self, pairs_W: Tensor, slot_R: Tensor) -> tuple[Exchange, int]:
        """All-gather every rank's pairs per destination and its widest pair: the exchange and K."""
        width = int(slot_R.max()) + 1 if slot_R.numel() else 1
        mine = torch.cat([pairs_W.cpu(), torch.tensor([width])])
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.groups.ep)
        rows_WW = torch.stack(every)
        g = self.groups
        plan = Exchange(rows_WW[:, : self.world], self.rank, g.ep, g.node_size, g.intra, g.inter)
        return plan, int(rows_WW[:, self.world].max())

    def _remote(self, plan: Exchange, ids_PK: Tensor, D: int, payload_PX: Tensor, ffn: ExpertsFn) -> Tensor:
        """Send the pairs, expand each received pair to its local experts, compute, sum per pair, send back."""
        received_QX = exchange(payload_PX, plan)
        ids_QK = plan.run(ids_PK)
        x_QD, w_QK = received_QX.split([D, ids_QK.shape[1]], dim=1)
        pair_A, slot_A = (ids_QK >= 0).nonzero(as_tuple=True)
        expert_A = ids_QK[pair_A, slot_A].long()
        # NOTE: stable, so each expert's rows keep the source-rank-then-token order they arrived in.
        order = torch.sort(expert_A, stable=True).indices
        pair_A, slot_A = pair_A[order], slot_A[order]
        counts = torch.bincount(expert_A, minlength=self.local_experts)
        y_AD = ffn(x_QD.index_select(0, pair_A), counts)
        weighted = y_AD * w_QK[pair_A, slot_A].unsqueeze(1).to(y_AD.dtype)
        y_QD = y_AD.new_zeros(x_QD.shape[0], D).index_add(0, pair_A, weighted)
        return exchange(y_QD, plan, reverse=True)


def _slot_in_pair(pair_R: Tensor, num_pairs: int) -> Tensor:
    """[R] each assignment's position among its pair's assignments, in the router's (k-major) order."""
    order = torch.sort(pair_R, stable=True).indices
    counts = torch.bincount(pair_R, minlength=num_pairs)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(pair_R)
    slot[order] = torch.arange(pair_R.numel(), device=pair_R.device) - starts[pair_R[order]]
    return slot
