"""MoE statistics in one place: what a layer measures per call, how micro-batches and ranks reduce
it, and what a training step logs.

To add a per-layer statistic: a field on ``MoEStats`` (filled in ``MoE._stats``; a count, or a
mean listed in ``_AVERAGED``), a column in ``_COLUMNS`` (its value summed over micro-batches and data
ranks) and its entry in ``StepStats.record``. Everything else (pipeline stages, data ranks, the logs) moves whole rows.

Legend: E experts of a layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class MoEStats:
    """Routing statistics and auxiliary losses of one forward call of one MoE layer."""

    # The losses are None where the forward skipped them (``MoE.forward(losses=False)``: decoding).
    aux_loss: Tensor | None  # Switch load-balancing loss (1.0 = uniform), differentiable
    z_loss: Tensor | None  # router z-loss, differentiable
    loss: Tensor | None  # aux_loss_coef * aux_loss + z_loss_coef * z_loss: add this to the training loss
    tokens_per_expert: Tensor  # [E] assignments routed to each expert (before capacity drops)
    dropped_per_expert: Tensor  # [E] assignments dropped by capacity limits
    num_tokens: int  # T

    @property
    def num_dropped(self) -> int:
        return int(self.dropped_per_expert.sum())


_AVERAGED = ("aux_loss", "z_loss", "loss")  # per-call means; every other field is a count, summed


def merge_micro_batches(per_micro: list[list[MoEStats]]) -> list[MoEStats]:
    """Per layer, the stats of several micro-batches as one: counts summed, losses averaged."""
    merged = []
    for layer in zip(*per_micro, strict=True):
        fields = {}
        for f in dataclasses.fields(MoEStats):
            values = [getattr(s, f.name) for s in layer]
            values = [v.detach() if isinstance(v, Tensor) else v for v in values]
            fields[f.name] = sum(values) / len(values) if f.name in _AVERAGED else sum(values)
        merged.append(MoEStats(**fields))
    return merged


# The scalar head of a layer's row, each summed over micro-batches and ranks; the row ends with the
# [E] routed counts. Sums reduce exactly, so a row crosses ranks and pipeline stages as one tensor.
_COLUMNS: dict[str, Callable[[MoEStats], Tensor | float]] = {
    "aux_sum": lambda s: s.aux_loss,
    "z_sum": lambda s: s.z_loss,
    "calls": lambda s: 1.0,  # stats added: micro-batches, or 1 for a pipeline step's merged stats
    "dropped": lambda s: s.dropped_per_expert.sum(),
}
_AT = {name: i for i, name in enumerate(_COLUMNS)}


def _row(s: MoEStats) -> Tensor:
    device = s.tokens_per_expert.device
    head = [torch.as_tensor(value(s), device=device).detach().float().reshape(1) for value in _COLUMNS.values()]
    return torch.cat([*head, s.tokens_per_expert.detach().float()])


class StepStats:
    """One optimizer step's MoE statistics: per MoE layer one row, summed over its calls.

    NOTE: rows stay on the layers' device until ``record`` copies them all to the host at once: one
    device sync per step rather than one per layer and micro-batch.
    """

    def __init__(self) -> None:
        self.layers: list[Tensor] = []  # one row per MoE layer, in the model's order

    def add(self, moe_stats: list[MoEStats]) -> None:
        for i, s in enumerate(moe_stats):
            row = _row(s)
            if i < len(self.layers):
                self.layers[i] = self.layers[i] + row
            else:
                self.layers.append(row)

    @property
    def loads(self) -> list[Tensor]:
        """Per layer, [E] assignments routed to each expert."""
        return [layer[len(_COLUMNS) :] for layer in self.layers]

    def _total(self, column: str) -> Tensor:
        return sum(layer[_AT[column]] for layer in self.layers)

    def record(self) -> dict[str, Any]:
        """The step's MoE metrics as the logs take them (per-layer lists where the value is per layer)."""
        if not self.layers:
            return {}
        on_host = StepStats()
        on_host.layers = list(torch.cat(self.layers).cpu().split([len(row) for row in self.layers]))
        return on_host._record()

    def _record(self) -> dict[str, Any]:
        loads = self.loads
        mean = [load.mean() for load in loads]
        calls = self._total("calls")
        routed = sum(load.sum() for load in loads)
        return {
            "aux_loss": (self._total("aux_sum") / calls).item(),
            "z_loss": (self._total("z_sum") / calls).item(),
            "load_max_over_mean": [(load.max() / m).item() for load, m in zip(loads, mean, strict=True)],
            "load_cv": [(load.std(unbiased=False) / m).item() for load, m in zip(loads, mean, strict=True)],
            "dropped_frac": (self._total("dropped") / routed.clamp(min=1)).item(),
            "expert_load": [(load / load.sum()).tolist() for load in loads],
        }
