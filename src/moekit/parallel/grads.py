"""The global gradient norm of a model spread over any mix of meshes (FSDP, ep, tp, pp)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def _distinct_shards(p: Tensor) -> int:
    """How many different pieces of ``p`` exist across the ranks that hold it."""
    if not isinstance(p, DTensor):
        return 1
    assert not any(pl.is_partial() for pl in p.placements), "gradients are reduced before their norm"
    # NOTE: FSDP over a tensor dimension tp or ep already shards gives a ``_StridedShard``, which is
    # neither a ``Shard`` nor ``is_shard()``: every placement but a replica splits the tensor.
    return math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if not pl.is_replicate())


def replicas(t: Tensor, stage_ranks: int) -> float:
    """How many ranks of a pipeline stage (``stage_ranks`` of them) hold the same piece as this rank's
    of ``t`` (a gradient, or a parameter placed like its gradient)."""
    return stage_ranks / _distinct_shards(t)


def combine_norms(group_norms: Iterable[tuple[float, Tensor]], distributed: bool) -> Tensor:
    """The global L2 norm from ``(replicas, L2 norm of this rank's pieces held by that many ranks)``.

    Each group's square is added in float64, divided by its replicas; with ``distributed``, one
    all-reduce over the world then counts each piece exactly once.
    """
    total = torch.zeros((), dtype=torch.float64)
    for count, norm in group_norms:
        total += norm.double().cpu().square() / count
    if distributed:
        dist.all_reduce(total)
    return total.sqrt().float()


@torch.no_grad()
def clip_grad_norm(params: list[Tensor], max_norm: float, stage_ranks: int = 1, distributed: bool = False) -> Tensor:
    """Clip gradients to a global L2 norm and return that norm (as ``clip_grad_norm_`` does).

    Every rank adds the squares of the gradient pieces it holds, divided by how many ranks of its
    pipeline stage (``stage_ranks`` of them) hold the same piece; with ``distributed``, one
    all-reduce over the world then sums each piece exactly once. ``torch.nn.utils.clip_grad_norm_`` cannot mix meshes.
    """
    grads = [p.grad for p in params if p.grad is not None]
    pieces = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    by_replicas: dict[float, list[Tensor]] = {}
    for g, piece in zip(grads, pieces, strict=True):
        by_replicas.setdefault(replicas(g, stage_ranks), []).append(piece)
    # NOTE: one foreach norm per group, in the gradients' dtype as clip_grad_norm_ does; a float64
    # copy of every gradient cost 3x as much on CPU.
    norm = combine_norms(((n, torch.nn.utils.get_total_norm(group)) for n, group in by_replicas.items()), distributed)
    scale = clip_scale(norm, max_norm)
    if scale < 1.0:
        torch._foreach_mul_(pieces, scale)
    return norm


def clip_scale(norm: Tensor, max_norm: float) -> float:
    """The factor gradients are multiplied by to bring their global ``norm`` to ``max_norm`` (1.0: none)."""
    if max_norm > 0 and math.isfinite(norm.item()):
        return (max_norm / (norm + 1e-6)).clamp(max=1.0).item()
    return 1.0
