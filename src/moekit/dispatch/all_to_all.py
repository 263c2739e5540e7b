"""Expert-parallel dispatch: tokens travel to the ranks that hold their experts and back.

Legend: T tokens, D model dim, E experts (global), El experts per rank, W ranks in the ep group,
C overlap chunks, R rows.

The data path of one layer (Tutel's, in five steps):
    local sort by expert -> exchange counts -> all-to-all rows -> grouped GEMM -> all-to-all back
Each rank has El slots; expert e runs in slot ``placement.expert_to_slot[e]`` on rank ``slot // El``
(the identity for plain expert parallelism), so rows sorted by slot are already ordered by destination
rank. Shadowed experts (replicated on every rank) sort after all slots and are computed where they
are, never sent. An exchange is differentiable: its backward is the reverse exchange.

Two exchange forms share one contract (input rows ordered by destination rank, output rows ordered
by source rank): a flat ``all_to_all_single``, and a two-level one (within a node, then across
nodes among ranks with the same local index: Tutel 2DH, SMILE) that sends fewer, larger messages
between nodes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moekit.dispatch.base import ScheduledExperts
from moekit.dispatch.local import DispatchMeta, LocalDispatcher
from moekit.experts.grouped import ExpertsFn
from moekit.routing import RouterOutput


def block_permutation(counts_AB: Tensor) -> Tensor:
    """Row index that reorders blocks laid out ``(a, b)``-major into ``(b, a)``-major order.

    ``counts_AB[a, b]`` is the length of block (a, b); the result gathers rows so that all blocks of
    b = 0 come first (in order of a), then b = 1, and so on.
    """
    counts_AB = counts_AB.long()
    starts = (torch.cumsum(counts_AB.flatten(), 0) - counts_AB.flatten()).view_as(counts_AB)
    lengths = counts_AB.t().flatten()
    block_starts = starts.t().flatten()
    total = int(lengths.sum())
    first_row = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths, output_size=total)
    return torch.repeat_interleave(block_starts, lengths, output_size=total) + torch.arange(total) - first_row


class _Permute(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``; its backward is a copy, not an accumulating scatter."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return torch.empty_like(grad).index_copy_(0, index, grad), None


def permute_rows(x: Tensor, index: Tensor) -> Tensor:
    return _Permute.apply(x, index)


@dataclass(frozen=True)
class Exchange:
    """One all-to-all of rows between the W ranks of an ep group, planned from the full count matrix.

    ``rows[s, d]`` is how many rows ep rank s sends ep rank d. ``run`` and ``reverse`` move plain
    tensors (no autograd); ``exchange`` wraps them into a differentiable op.
    """

    rows: Tensor  # [W, W] on CPU
    rank: int  # this rank's index in the ep group
    group: dist.ProcessGroup
    node_size: int = 0  # > 0: two-level exchange with nodes of this many ep ranks
    intra_group: dist.ProcessGroup | None = None  # ranks of this rank's node
    inter_group: dist.ProcessGroup | None = None  # ranks with this rank's local index, one per node

    def run(self, x: Tensor) -> Tensor:
        return self._move(x, self.rows)

    def reverse(self, x: Tensor) -> Tensor:
        return self._move(x, self.rows.t())

    def _move(self, x: Tensor, rows: Tensor) -> Tensor:
        if self.node_size:
            return self._two_level(x, rows)
        return _all_to_all(x, rows[:, self.rank].tolist(), rows[self.rank].tolist(), self.group)

    def _two_level(self, x: Tensor, rows: Tensor) -> Tensor:
        S = self.node_size
        N = rows.shape[0] // S
        node, local = divmod(self.rank, S)
        # Phase 1, within the node: to local rank l' go the rows for every node's rank l', by node.
        mine = rows[self.rank].view(N, S)  # [dst node, dst local]
        x = x.index_select(0, block_permutation(mine))
        from_node = rows[node * S : (node + 1) * S, local::S]  # [src local, dst node] rows for my local index
        x = _all_to_all(x, from_node.sum(1).tolist(), mine.sum(0).tolist(), self.intra_group)
        # Phase 2, across nodes: to node n'' go the rows of all my node's sources for rank (n'', local).
        x = x.index_select(0, block_permutation(from_node))
        to_me = rows[:, self.rank].view(N, S).sum(1)  # rows from each source node
        return _all_to_all(x, to_me.tolist(), from_node.sum(0).tolist(), self.inter_group)


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _Exchanged(torch.autograd.Function):
    """Differentiable exchange, forward (dispatch) or ``reverse`` (combine); the backward runs the
    other direction. ``result`` may be precomputed (overlap)."""

    @staticmethod
    def forward(ctx, x: Tensor, plan: Exchange, result: Tensor | None, reverse: bool) -> Tensor:
        ctx.plan, ctx.reverse = plan, reverse
        if result is not None:
            return result
        return plan.reverse(x) if reverse else plan.run(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        return (ctx.plan.run(grad) if ctx.reverse else ctx.plan.reverse(grad)), None, None, None


def exchange(x: Tensor, plan: Exchange, result: Tensor | None = None, reverse: bool = False) -> Tensor:
    return _Exchanged.apply(x, plan, result, reverse)


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each expert of a layer runs, swapped whole between steps (``parallel/rebalance.py``)."""

    expert_to_slot: tuple[int, ...]  # [E] slot of each expert (a permutation); its rank is slot // El
    shadows: tuple[int, ...] = ()  # experts replicated on every rank: their rows stay here
    shadow_experts: ExpertsFn | None = None  # computes the shadows' rows, grouped in ``shadows`` order

    @staticmethod
    def identity(num_experts: int) -> ExpertPlacement:
        return ExpertPlacement(tuple(range(num_experts)))

    def sort_keys(self) -> Tensor:
        """[E] the dispatch order: slots first, then the shadows after all E slots."""
        keys = torch.tensor(self.expert_to_slot)
        for i, e in enumerate(self.shadows):
            keys[e] = len(keys) + i
        return keys


@dataclass(frozen=True)
class EPGroups:
    """The process groups an expert-parallel dispatcher talks over."""

    ep: dist.ProcessGroup
    node_size: int = 0  # > 0: two-level exchange with nodes of this many ep ranks
    intra: dist.ProcessGroup | None = None  # this rank's node
    inter: dist.ProcessGroup | None = None  # this rank's local index on every node


@dataclass(frozen=True)
class _Chunks:
    """One layer's exchange, planned: per overlap chunk its all-to-all and the rows it brings."""

    plans: list[Exchange]  # [C]
    received: list[Tensor]  # [C] of [W, El]: rows from each source rank for each local expert
    order: Tensor | None  # rows sorted by slot -> by (chunk, slot); None without overlap


class AllToAllDispatcher:
    """Dropless or capacity dispatch across the ep group; capacity is per rank, as in DeepSpeed-MoE.

    With ``chunks > 1`` every (rank, expert) block is cut into C row chunks; a background thread
    exchanges them in order while the experts compute the chunks already received, and sends each
    result back while the next computes (Tutel / FasterMoE pipelining). Backward exchanges run in
    the autograd thread.
    """

    def __init__(
        self, num_experts: int, groups: EPGroups, capacity_factor: float | None = None, chunks: int = 1
    ) -> None:
        self.world = dist.get_world_size(groups.ep)
        assert num_experts % self.world == 0, "ep must divide num_experts (checked by the layout)"
        self.local_experts = num_experts // self.world
        self.rank = dist.get_rank(groups.ep)
        self.groups = groups
        self.chunks = chunks
        self.local = LocalDispatcher(num_experts, capacity_factor)
        self.placement = ExpertPlacement.identity(num_experts)  # changed only through ``place``
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moekit-a2a") if chunks > 1 else None

    def apply(self, x_TD: Tensor, routing: RouterOutput, experts: ScheduledExperts) -> tuple[Tensor, DispatchMeta]:
        """Route rows to their experts' ranks, compute them there, bring them back and combine.

        The experts module is called once per layer with the exchange as its schedule, however many
        overlap chunks it computes: FSDP then gathers sharded experts once per pass, not per chunk.
        """
        placement = self.placement
        keys = placement.sort_keys().to(routing.expert_idx.device)
        x_sorted, meta = self.local.dispatch(x_TD, routing, keys)
        per_key = meta.tokens_per_expert.cpu()
        meta = dataclasses.replace(
            meta, tokens_per_expert=meta.tokens_per_expert[keys], routed_per_expert=meta.routed_per_expert[keys]
        )
        E = self.world * self.local_experts
        x_sorted, x_shadow = torch.split(x_sorted, [int(per_key[:E].sum()), int(per_key[E:].sum())])
        chunks = self._plan_chunks(per_key[:E])
        y = experts(x_sorted, schedule=functools.partial(self._exchange_and_compute, chunks))
        if placement.shadows:
            assert placement.shadow_experts is not None
            y = torch.cat([y, placement.shadow_experts(x_shadow, per_key[E:].to(x_shadow.device))])
        return LocalDispatcher.combine(y, meta), meta

    def place(self, placement: ExpertPlacement) -> None:
        """Run the experts where ``placement`` says from the next call on (the caller moved their weights)."""
        slots = placement.expert_to_slot
        if sorted(slots) != list(range(self.world * self.local_experts)):
            raise ValueError(
                f"expert_to_slot must be a permutation of the {self.world * self.local_experts} slots: {slots}"
            )
        if placement.shadows and placement.shadow_experts is None:
            raise ValueError(f"shadow experts {placement.shadows} without the function that computes them")
        self.placement = placement

    def _plan_chunks(self, counts_E: Tensor) -> _Chunks:
        """Cut each slot's rows into C chunks and learn, from every rank's counts, what each exchange moves."""
        W, El, C = self.world, self.local_experts, self.chunks
        counts_EC = _split_counts(counts_E, C)  # [slots, C]
        every = [torch.empty_like(counts_EC) for _ in range(W)]
        dist.all_gather(every, counts_EC, group=self.groups.ep)
        to_rank_WWLC = torch.stack(every).view(W, W, El, C)  # [src, dst rank, dst's local expert, chunk]
        plans = [self._plan(to_rank_WWLC[..., c].sum(2)) for c in range(C)]
        received = [to_rank_WWLC[:, self.rank, :, c] for c in range(C)]  # [src, local expert] rows to compute
        order = block_permutation(counts_EC) if C > 1 else None
        return _Chunks(plans, received, order)

    def _exchange_and_compute(self, chunks: _Chunks, x_sorted: Tensor, experts: ExpertsFn) -> Tensor:
        """Send each chunk to its experts' ranks, compute it there and send it back; with overlap the
        background thread exchanges chunk c + 1 and returns chunk c - 1 while chunk c computes."""
        if chunks.order is not None:
            x_sorted = permute_rows(x_sorted, chunks.order.to(x_sorted.device))
        chunks_in = torch.split(x_sorted, [int(p.rows[self.rank].sum()) for p in chunks.plans])
        sent = self._start([(p.run, x) for p, x in zip(chunks.plans, chunks_in, strict=True)])
        outs, returned = [], []
        for c, (plan, received_WL) in enumerate(zip(chunks.plans, chunks.received, strict=True)):
            regroup = block_permutation(received_WL).to(x_sorted.device)  # [src][expert] -> [expert][src]
            x_c = permute_rows(exchange(chunks_in[c], plan, _result(sent[c])), regroup)
            y_c = permute_rows(experts(x_c, received_WL.sum(0).to(x_c.device)), _inverse(regroup))
            outs.append(y_c)
            returned += self._start([(plan.reverse, y_c)])
        y = torch.cat(
            [
                exchange(y_c, plan, _result(f), reverse=True)
                for y_c, plan, f in zip(outs, chunks.plans, returned, strict=True)
            ]
        )
        if chunks.order is not None:
            y = permute_rows(y, _inverse(chunks.order.to(y.device)))
        return y

    def _plan(self, rows_WW: Tensor) -> Exchange:
        g = self.groups
        return Exchange(rows_WW, self.rank, g.ep, g.node_size, g.intra, g.inter)

    def _start(self, work: list[tuple[Callable[[Tensor], Tensor], Tensor]]) -> list[Future | None]:
        """With overlap, queue exchanges on the background thread (FIFO: the same order on every rank)."""
        if self._pool is None:
            return [None] * len(work)
        return [self._pool.submit(fn, x.detach()) for fn, x in work]


def _result(future: Future | None) -> Tensor | None:
    return None if future is None else future.result()


def _inverse(index: Tensor) -> Tensor:
    return torch.empty_like(index).scatter_(0, index, torch.arange(index.numel(), device=index.device))


def _split_counts(counts_E: Tensor, chunks: int) -> Tensor:
    """[E, C]: each expert's rows cut into C nearly equal consecutive chunks."""
    base, extra = counts_E // chunks, counts_E % chunks
    return base.unsqueeze(1) + (torch.arange(chunks) < extra.unsqueeze(1)).long()
