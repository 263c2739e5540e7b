"""Data parallelism with FSDP2 (``fully_shard``), applied last.

Non-expert parameters are sharded over ``batch`` (dp x ep): every rank of it sees different tokens.
Routed experts are sharded over ``dp`` only (``expert_sharding = "shard"``) or kept whole on every dp
rank with their gradients all-reduced over dp (``"replicate"``). Either way an expert's gradient ends
as the mean over all dp x ep ranks' losses, like every other gradient, and equal on every rank that
holds a copy: the all-to-all backward already summed the contributions of the ep ranks, so the dp
reduction divides by dp x ep. (tp ranks hold copies too, but read the same tokens: their expert
gradients are equal already.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from moekit.config import ParallelConfig
from moekit.parallel.ep import expert_parameters
from moekit.parallel.mesh import Layout, RunMesh


def experts_sharded(layout: Layout, cfg: ParallelConfig) -> bool:
    """Whether FSDP shards the routed experts over dp (else each dp rank keeps a whole copy)."""
    return cfg.expert_sharding == "shard" and layout.dp > 1


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: RunMesh, layout: Layout, cfg: ParallelConfig) -> None:
    """Shard each block, then the rest of the model, over the batch ranks."""
    if layout.batch_ranks == 1:
        return
    experts = set(expert_parameters(model))
    shard_experts = experts_sharded(layout, cfg)
    ignored = set() if shard_experts else experts
    for block in blocks:
        if shard_experts:
            for moe_experts in _expert_modules(block):
                fully_shard(moe_experts, mesh=mesh["dp"])
        fully_shard(block, mesh=mesh["batch"], ignored_params=ignored & set(block.parameters()) or None)
    fully_shard(model, mesh=mesh["batch"], ignored_params=ignored or None)


def _expert_modules(block: nn.Module) -> list[nn.Module]:
    return [m for name, m in block.named_modules() if name.endswith("experts") and hasattr(m, "w_in")]


@torch.no_grad()
def finish_expert_grads(model: nn.Module, mesh: RunMesh, layout: Layout, cfg: ParallelConfig) -> None:
    """Turn expert gradients into the mean over all dp x ep ranks' losses, the same on every copy.

    Before this, a replicated expert's gradient holds only its own dp rank's tokens. FSDP already
    averaged sharded experts over dp, leaving the 1 / ep; replicated experts are summed over dp here
    (one all-reduce of all of them) and divided by dp x ep. (FSDP's own divide factor would need a
    pre-multiplied sum, which gloo lacks.)
    """
    if layout.batch_ranks == 1:
        return
    grads = [p.grad for p in expert_parameters(model) if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if not local:
        return
    if experts_sharded(layout, cfg):
        if layout.ep > 1:
            torch._foreach_div_(local, float(layout.ep))
        return
    if layout.dp > 1:
        flat = torch.cat([g.flatten() for g in local])
        dist.all_reduce(flat, group=mesh["dp"].get_group())
        torch._foreach_copy_(
            local, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in local]), local, strict=True)]
        )
    torch._foreach_div_(local, float(layout.batch_ranks))
