"""Expert parallelism, applied to a built model: each ep rank keeps num_experts / ep experts of every
MoE layer (as a DTensor sharded on the ``ep`` mesh dimension) and the layer's dispatcher becomes
the all-to-all one. Routers, shared experts and everything else stay whole on every rank."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from moekit.config import ParallelConfig
from moekit.dispatch.all_to_all import AllToAllDispatcher, EPGroups
from moekit.dispatch.dedup import DedupDispatcher
from moekit.layer import MoE
from moekit.model import Transformer
from moekit.parallel.mesh import Layout, RunMesh


def ep_groups(mesh: RunMesh, layout: Layout, cfg: ParallelConfig) -> EPGroups:
    if cfg.all_to_all == "two_level":
        return EPGroups(
            mesh["ep"].get_group(), layout.node_size, mesh["ep_local"].get_group(), mesh["ep_node"].get_group()
        )
    return EPGroups(mesh["ep"].get_group())


def apply_ep(model: Transformer, mesh: RunMesh, layout: Layout, cfg: ParallelConfig) -> None:
    """Shard every MoE layer's experts over ``mesh["ep"]`` and swap in the all-to-all dispatcher."""
    if layout.ep == 1:
        return
    groups = ep_groups(mesh, layout, cfg)
    for moe in model.moe_layers():
        shard_moe(moe, mesh, groups, cfg)


def shard_moe(moe: MoE, mesh: RunMesh, groups: EPGroups, cfg: ParallelConfig) -> None:
    """One MoE layer: its experts sharded over ``mesh["ep"]``, its dispatcher the all-to-all one (per
    expert, or per rank with ``parallel.dispatch_dedup``)."""
    for name, weight in list(moe.experts.named_parameters(recurse=False)):
        # NOTE: rank 0's experts are scattered; weights on the meta device (kept elsewhere, each rank its
        # own shard: offloaded training) have nothing to scatter, and are only split
        source = None if weight.is_meta else 0
        sharded = distribute_tensor(weight.detach(), mesh["ep"], [Shard(0)], src_data_rank=source)
        setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
    if cfg.dispatch_dedup:
        moe.dispatcher = DedupDispatcher(moe.cfg.num_experts, groups)
    else:
        capacity = moe.dispatcher.capacity_factor
        moe.dispatcher = AllToAllDispatcher(moe.cfg.num_experts, groups, capacity, cfg.overlap_chunks)


def expert_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    """The routed experts' weights in model order (reduced over dp only; the rest over dp x ep)."""
    return [p for moe in model.moe_layers() for p in moe.experts.parameters()]
