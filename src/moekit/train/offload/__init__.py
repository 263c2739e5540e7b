"""Training beyond memory: MoE experts' weights and AdamW state offloaded to disk (``train.memory_budget``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moekit.parallel.mesh import Layout, LayoutError
from moekit.runconfig import RunConfig
from moekit.train.offload.engine import ExpertOffload

__all__ = ["ExpertOffload", "offload_experts"]


def offload_experts(
    cfg: RunConfig, run_dir: Path, layout: Layout, device: torch.device, model: nn.Module, optimizer
) -> ExpertOffload:
    """Offload ``model``'s experts under ``cfg.train.memory_budget``, or refuse a run it does not support."""
    tc = cfg.train
    budget = f"train.memory_budget={tc.memory_budget!r}"
    if layout.world > 1:
        raise LayoutError(
            f"{budget}: offloaded training runs in one process; parallel.dp, ep, tp and pp must be 1 "
            f"(got {layout.dp} x {layout.ep} x {layout.tp} x {layout.pp})"
        )
    refusals = [
        (not cfg.is_moe, "the model has no MoE layers to offload"),
        (device.type != "cpu", f"device={device.type}: offloaded training runs on cpu"),
        (tc.dtype != "fp32", f"train.dtype={tc.dtype!r}: offloaded training runs in fp32"),
        (tc.compile, "train.compile=true: offloaded experts run eagerly"),
        (tc.async_checkpoint, "train.async_checkpoint=true: offloaded experts are checkpointed synchronously"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{budget}: {why}")
    directory = Path(tc.offload_dir) if tc.offload_dir else Path(run_dir) / "offload"
    return ExpertOffload(model, optimizer, tc.memory_budget, directory)
