"""One optimizer step, and the model/optimizer seam offloaded experts sit behind.

``ExpertStorage`` is where the experts' weights and optimizer state live, as a step and a checkpoint
meet them: resident (``RESIDENT``: the model and the optimizer hold them, so there is nothing to
do) or offloaded (``train.offload.TrainingOffload``: gradients out per layer, the clip norm taken
from their norms, the AdamW step deferred to the next forward, checkpoints streamed). The loop and
``train_step`` call the same methods either way.
"""

from __future__ import annotations

import contextlib
import math
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from moekit.errors import MoekitError
from moekit.parallel.runtime import ParallelModel
from moekit.run.planners import Streamed
from moekit.runconfig import RunConfig
from moekit.stats import StepStats
from moekit.train.data import Corpus, draw_seed
from moekit.train.optim import lr_at


class TrainingError(MoekitError):
    """Training stopped for a reason the user must see (a NaN loss or weights, a run dir in the way)."""


class ExpertStorage(Protocol):
    """The experts' part of a step and of a checkpoint, wherever their state lives."""

    def begin_step(self, grad_accum: int) -> None:
        """A new optimizer step of ``grad_accum`` micro-batches starts."""
        ...

    def clip_gradients(self, pm: ParallelModel, max_norm: float) -> Tensor:
        """Clip every gradient of ``pm`` to ``max_norm`` together; the norm before clipping."""
        ...

    def step(self) -> None:
        """The experts' optimizer update, after ``optimizer.step()``."""
        ...

    def saving(self, model: nn.Module) -> AbstractContextManager[Streamed | None]:
        """While a checkpoint of ``model`` is written: the state it reads itself (None: all in the model)."""
        ...

    def restoring(self, model: nn.Module) -> AbstractContextManager[Streamed | None]:
        """While a checkpoint is loaded into ``model``: the state it fills itself (None: all in the model)."""
        ...

    def weights_finite(self) -> bool:
        """Whether the expert weights held outside the model are finite (True: none are)."""
        ...

    def close(self) -> None:
        """The run is over (or failed): let go of what the experts hold outside the model."""
        ...


class ResidentExperts:
    """Experts in memory: the model and its optimizer hold them; nothing more to do."""

    def begin_step(self, grad_accum: int) -> None:
        pass

    def clip_gradients(self, pm: ParallelModel, max_norm: float) -> Tensor:
        return pm.clip_gradients(max_norm)

    def step(self) -> None:
        pass

    def saving(self, model: nn.Module) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def restoring(self, model: nn.Module) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def weights_finite(self) -> bool:
        return True

    def close(self) -> None:
        pass


RESIDENT = ResidentExperts()


def autocast(cfg: RunConfig, device: torch.device) -> AbstractContextManager[Any]:
    if cfg.train.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def last_good(checkpoint: Path | None) -> str:
    """The end of a message that stops training: where its last good state is."""
    return f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    corpus: Corpus,
    cfg: RunConfig,
    dev: torch.device,
    step: int,
    checkpoint: Path | None,
    experts: ExpertStorage = RESIDENT,
) -> dict[str, Any]:
    """One optimizer step over ``grad_accum`` micro-batches per rank; returns the step's metrics.

    Rank b of the N data-reading ranks takes micro-batches b, b + N, ...: the same samples, in the
    same order, as one process with N times the gradient accumulation, and its random draws are seeded
    by its position (``draw_seed``), so they are that process's too. A step whose gradient norm is
    NaN or inf is skipped (``record["skipped"]``): its data is consumed but nothing is updated.
    """
    tc = cfg.train
    lr = lr_at(step, tc)
    for group in optimizer.param_groups:
        group["lr"] = lr
    for moe in pm.moe_layers():
        moe.set_step(step)
    experts.begin_step(tc.grad_accum)
    stats = StepStats()
    lm_loss = torch.zeros(())
    ranks = pm.ranks
    for micro in range(tc.grad_accum):
        index = (step * tc.grad_accum + micro) * ranks.batch_ranks + ranks.batch_rank
        x, y = corpus.batch("train", index, tc.batch_size, cfg.model.context_length, tc.seed)
        torch.manual_seed(draw_seed(index, tc.seed))
        with autocast(cfg, dev):
            loss, lm, moe_stats = pm.forward_backward(x.to(dev), y.to(dev), 1.0 / tc.grad_accum)
        lm_loss = lm_loss + lm.float().cpu() / tc.grad_accum
        loss_value = pm.mean_over_batch(pm.broadcast_from_last_stage(loss)).item()
        if not math.isfinite(loss_value):
            raise TrainingError(f"loss is {loss_value} at step {step + 1}: training stopped; {last_good(checkpoint)}")
        stats.add(moe_stats)
    pm.finish_gradients()
    grad_norm = experts.clip_gradients(pm, tc.grad_clip)
    # NOTE: the norm is all-reduced over every rank, so all ranks skip the same steps. A skipped step
    # leaves the weights, the optimizer state (its step count too) and the router biases as they were;
    # the learning rate is a function of the step index (the data position), so no schedule is held back.
    skipped = not math.isfinite(grad_norm.item())
    if not skipped:
        optimizer.step()
        experts.step()
    optimizer.zero_grad(set_to_none=True)
    stats.layers = pm.reduce_layers(stats.layers)
    placement = pm.rebalance(step, stats.loads, optimizer)
    if not skipped:
        for moe in pm.moe_layers():
            moe.update_bias(stats.loads[moe.index].to(dev))
    lm_loss = pm.mean_over_batch(pm.broadcast_from_last_stage(lm_loss))
    record = {"step": step + 1, "loss": lm_loss.item(), "lr": lr, "grad_norm": grad_norm.item(), "skipped": skipped}
    return {**record, **stats.record(), **placement}
