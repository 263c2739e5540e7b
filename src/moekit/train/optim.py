"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine learning rate."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moekit.config import TrainConfig


def build_optimizer(parameters: Iterable[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """Decay matrices (embeddings, projections, stacked experts); not norms or other vectors.

    Parameters are grouped by decay and by how they are distributed (plain, or DTensor on a mesh):
    the fused kernel takes one kind per call.
    """
    groups: dict[tuple, dict] = {}
    for p in parameters:
        if not p.requires_grad:
            continue
        decay = cfg.weight_decay if p.dim() >= 2 else 0.0
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        key = (decay, id(mesh))
        groups.setdefault(key, {"params": [], "weight_decay": decay})["params"].append(p)
    # NOTE: the fused kernel (CPU and CUDA) is one pass over each tensor; on the shakespeare-moe
    # preset it took a step from 100 ms to 80 ms on a 2-core CPU, the foreach form being 20% of it.
    return torch.optim.AdamW(list(groups.values()), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
