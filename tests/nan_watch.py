"""A NaN gradient at chosen training steps, injected through PyTorch's global hooks into whatever model
a ``train`` call builds, and what that call's steps left behind."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from moekit.model import Transformer


class Watch:
    """Watches one ``train`` call through PyTorch's global hooks: the model it trains (first forward),
    every ``optimizer.step()`` it makes, and the state after each step (``on_step``). At the steps in
    ``nan_steps`` (numbered from 1, the resumed run's first step being ``first_step``) a hook on the
    embedding's output replaces its gradient with NaN, as an overflow in backward would; that reaches
    ``embed.weight.grad`` however the model is sharded."""

    def __init__(self, nan_steps: set[int], first_step: int = 1) -> None:
        self.nan_steps, self.next_step = nan_steps, first_step
        self.model: Transformer | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_steps = 0
        self.states: dict[int, dict[str, Tensor]] = {}  # step -> model state_dict after it
        self.adam: dict[int, list[Tensor]] = {}  # step -> every optimizer state tensor after it
        self.adam_steps: dict[int, float] = {}  # step -> AdamW's own step count after it
        self._poison: RemovableHandle | None = None
        self._hooks: list[RemovableHandle] = []

    def __enter__(self) -> Watch:
        self._hooks = [register_module_forward_pre_hook(self._forward), register_optimizer_step_post_hook(self._step)]
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None):
        for handle in [*self._hooks, *([self._poison] if self._poison else [])]:
            handle.remove()

    def _forward(self, module: nn.Module, args: Any) -> None:
        if not isinstance(module, Transformer) or not module.training:
            return  # one training forward of the whole model per step (grad_accum = 1)
        self.model = module
        if self._poison is not None:
            self._poison.remove()
            self._poison = None
        if self.next_step in self.nan_steps:
            self._poison = module.embed.register_forward_hook(_nan_gradient)
        self.next_step += 1

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer = optimizer
        self.optimizer_steps += 1

    def on_step(self, record: dict[str, Any]) -> None:
        assert self.model is not None and self.optimizer is not None
        self.states[record["step"]] = {k: local(v).clone() for k, v in self.model.state_dict().items()}
        self.adam[record["step"]] = [t.clone() for s in self.optimizer.state.values() for t in s.values()]
        self.adam_steps[record["step"]] = next(iter(self.optimizer.state.values()))["step"].item()


def _nan_gradient(module: nn.Module, args: Any, out: Tensor) -> None:
    out.register_hook(lambda grad: torch.full_like(grad, float("nan")))


def local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # this rank's piece of a DTensor
