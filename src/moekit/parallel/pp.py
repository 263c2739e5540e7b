"""Pipeline parallelism with ``torch.distributed.pipelining``: the model cut into stages by layers.

Each pipeline rank holds ``stages_per_rank`` stages (two for the interleaved and looped schedules,
stage s on rank ``s % pp``). MoE auxiliary losses never travel with the activations: each MoE block
attaches its loss to the hidden state with ``_AttachAuxLoss``, whose backward feeds the loss its
gradient, so every stage's routers learn as in the unpipelined model (the aux losses of early
stages are what peers lose). Losses and load statistics are collected per stage and reduced after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from moekit.layer import MoE
from moekit.model import Transformer
from moekit.stats import MoEStats

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
}


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also starts the backward of ``aux`` (with gradient ``scale``).

    Returns a copy, not a view of ``x``: a view ending a stage is what FSDP2 warns about on a sharded
    module's output (a later in-place op on it would skip the stage's pre-backward all-gather)."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class StageModel(nn.Module):
    """The layers ``[first, last)`` of a Transformer, plus the embedding on the first stage and the
    final norm and output head on the last. Parameter names are the full model's (``blocks.3...``)."""

    def __init__(self, model: Transformer, layers: range, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.embed = model.embed if is_first else None
        self.drop = model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.register_buffer("rope_freqs", model.rope_freqs, persistent=False)
        self.aux_scale = 1.0  # gradient of each aux loss (1 / micro-batches of the optimizer step)
        self.stats: list[list[MoEStats]] = []  # per micro-batch, this stage's MoE blocks in order

    def forward(self, h: Tensor) -> Tensor:
        x = self.drop(self.embed(h)) if self.embed is not None else h
        freqs = self.rope_freqs[: x.shape[1]]
        stats = []
        for index, block in self.blocks.items():
            x, s = block(x, freqs, None, int(index), None)
            if s is not None:
                stats.append(s)
                if self.training and s.loss.requires_grad:
                    x = _AttachAuxLoss.apply(x, s.loss, self.aux_scale)
        self.stats.append(stats)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.blocks.values() if isinstance(b.ffn, MoE)]


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges, as even as possible (earlier stages take the extra layers)."""
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


class ScaledLoss:
    """The schedule's loss: cross-entropy times ``scale`` (1 / all micro-batches of the optimizer step).

    NOTE: the schedules' own ``scale_grads`` divides every gradient at the end of each ``step()``,
    including what earlier gradient-accumulation steps left there; scaling the loss instead keeps
    the step's gradient the mean over all its micro-batches.
    """

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) * self.scale


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them."""

    stages: list[StageModel]
    schedule: object
    loss: ScaledLoss
    microbatches: int
    has_first: bool
    has_last: bool

    def collect_stats(self) -> list[list[MoEStats]]:
        """Per micro-batch, this rank's MoE stats in layer order; clears them for the next step.

        Only the schedule's last ``microbatches`` forwards count: the first step also runs a
        shape-inference forward, whose routing must not enter the load statistics.
        """
        by_stage = [s.stats[-self.microbatches :] for s in self.stages]
        for s in self.stages:
            s.stats = []
        micro = max((len(x) for x in by_stage), default=0)
        return [[st for stage in by_stage if i < len(stage) for st in stage[i]] for i in range(micro)]


def build_stages(model: Transformer, pp_mesh: DeviceMesh, stages_per_rank: int) -> list[StageModel]:
    """This rank's stage models (stage s lives on pipeline rank s % pp)."""
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_stages = pp * stages_per_rank
    ranges = stage_layers(model.cfg.n_layers, n_stages)
    ids = [rank + k * pp for k in range(stages_per_rank)]
    return [StageModel(model, ranges[s], s == 0, s == n_stages - 1) for s in ids]


def build_pipeline(
    stages: list[StageModel], pp_mesh: DeviceMesh, schedule: str, microbatches: int, device: torch.device
) -> Pipeline:
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_stages = pp * len(stages)
    ids = [rank + k * pp for k in range(len(stages))]
    group = pp_mesh.get_group()
    pipe_stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(stages, ids, strict=True)]
    cls = SCHEDULES[schedule]
    driver = pipe_stages if len(pipe_stages) > 1 else pipe_stages[0]
    loss = ScaledLoss()
    sched = cls(driver, n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
    return Pipeline(stages, sched, loss, microbatches, has_first=0 in ids, has_last=n_stages - 1 in ids)
