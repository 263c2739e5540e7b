"""The experts' AdamW step, deferred to the next forward: each layer is updated where its weights are read.

``record`` (at the optimizer step) updates nothing: it takes down what each layer's update needs as
the step has it, the gradient clipping factor and each parameter group's hyperparameters (the loop
sets the next step's learning rate before that step's forward), and the step counts, which it
advances in the optimizer's state as in-memory training does at its step. It starts reading the
first layer's gradient, moments and weights. ``settle(layer)``, called by a forward that reaches
``layer`` (training, evaluation) or by whatever needs the whole state (a checkpoint), runs the
pending updates up to that layer in order, on the weights' slot: the forward then computes with the
updated weights in place, the new weights and moments are written behind, and the next pending
layer's reads are started to arrive while this one computes. An update leaves the pending set only
as its arithmetic starts (so it can never run twice); a read that fails leaves it pending.

The arithmetic is ``torch.optim``'s fused AdamW on the same whole stacked tensors, with the same step
counts and hyperparameters, so the bits are in-memory training's.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim.adam import adam

from moekit.train.offload.store import Experts, LayerFile
from moekit.train.offload.working_set import WorkingSet

MOMENTS = ("grad", "exp_avg", "exp_avg_sq")  # what the AdamW step reads beside the weights
_HYPERPARAMETERS = ("betas", "lr", "weight_decay", "eps", "amsgrad", "maximize")


@dataclass(frozen=True)
class _GroupStep:
    """One parameter group's share of a layer's update: which roles, their counts before the step, the
    group's hyperparameters at the step."""

    roles: list[str]
    steps: list[Tensor]
    hyper: dict


@dataclass(frozen=True)
class _Reads:
    layer: int
    bufs: list[Tensor]  # gradient, exp_avg, exp_avg_sq
    futures: list[Future[None]]


class DeferredAdamW:
    """Pending AdamW updates of offloaded expert layers, run in layer order as forwards reach them.

    ``buffers``: two sets of ``len(MOMENTS)`` RAM regions (one layer's arriving while the other's is
    updated); ``params[l]``: layer l's expert parameters, in ``roles`` order.
    """

    def __init__(
        self,
        ws: WorkingSet,
        file: LayerFile,
        buffers: list[Tensor],
        params: list[list[nn.Parameter]],
        roles: list[str],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        assert len(buffers) == 2 * len(MOMENTS)
        self.ws, self.file, self.params, self.roles, self.optimizer = ws, file, params, roles, optimizer
        self._sets = [buffers[: len(MOMENTS)], buffers[len(MOMENTS) :]]
        self._next_set = 0
        # layer -> (clip factor, its groups, the experts whose gradient is on disk: the others' is zero)
        self._pending: dict[int, tuple[float, list[_GroupStep], Experts]] = {}
        self._reads: _Reads | None = None  # of the lowest pending layer, started ahead

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    @torch.no_grad()
    def record(self, scale: float, routed: list[Experts]) -> None:
        """An optimizer step of every layer's experts, with gradients clipped by ``scale``: to run later.
        ``routed[l]``: layer l's experts whose gradient was written; the others' is read as zeros (an
        expert that received no token still takes its AdamW update: moments decay, weights move)."""
        assert not self._pending, "the previous step's updates ran in this step's forward"
        for layer, params in enumerate(self.params):
            by_group: dict[int, list[int]] = {}
            for i, p in enumerate(params):
                by_group.setdefault(self._group_of(p), []).append(i)
            groups = []
            for index, members in by_group.items():
                group = self.optimizer.param_groups[index]
                steps = [self._advance_step(params[i]) for i in members]
                hyper = {k: group[k] for k in _HYPERPARAMETERS}
                hyper["decoupled_weight_decay"] = group.get("decoupled_weight_decay", True)
                groups.append(_GroupStep([self.roles[i] for i in members], steps, hyper))
            self._pending[layer] = (scale, groups, routed[layer])
        self._reads = self._start_reads(0)
        self.ws.prefetch(0, +1)

    @torch.no_grad()
    def settle(self, upto: int) -> None:
        """Run every pending update of layers ``<= upto``, lowest first."""
        while self._pending and min(self._pending) <= upto:
            self._run(min(self._pending))

    def _run(self, layer: int) -> None:
        weights = self.ws.get(layer, +1)
        try:
            bufs = self._arrived(layer)
            scale, groups, _ = self._pending.pop(layer)
            if self._pending:  # the next layer arrives while this one is updated and computes
                self._reads = self._start_reads(min(self._pending))
                self.ws.prefetch(min(self._pending), +1)
            self.ws.wait_buffer(weights)  # the slot's last write has left it before it changes
            self._adamw(weights, bufs, scale, groups)
            self.ws.write(layer, "weight", weights)
            for kind, buf in zip(MOMENTS[1:], bufs[1:], strict=True):
                self.ws.write(layer, kind, buf)
        finally:
            self.ws.release(layer)

    def _arrived(self, layer: int) -> list[Tensor]:
        """The layer's gradient and moments in RAM: the reads started ahead, or started now."""
        reads, self._reads = self._reads, None
        if reads is not None and reads.layer != layer:
            for future in reads.futures:
                future.result()
            reads = None
        reads = reads or self._start_reads(layer)
        for future in reads.futures:
            future.result()
        return reads.bufs

    def _start_reads(self, layer: int) -> _Reads:
        bufs = self._sets[self._next_set]
        self._next_set ^= 1
        routed = self._pending[layer][2]
        experts = [routed if kind == "grad" else None for kind in MOMENTS]
        reads = [self.ws.read(layer, *read) for read in zip(MOMENTS, bufs, experts, strict=True)]
        return _Reads(layer, bufs, reads)

    def _adamw(self, weights: Tensor, bufs: list[Tensor], scale: float, groups: list[_GroupStep]) -> None:
        w, (g, m, v) = self.file.views(weights), (self.file.views(b) for b in bufs)
        if scale < 1.0:
            torch._foreach_mul_([g[r] for r in self.roles], scale)
        for group in groups:
            hyper = dict(group.hyper)
            beta1, beta2 = hyper.pop("betas")
            roles = group.roles
            adam(
                [w[r] for r in roles],
                [g[r] for r in roles],
                [m[r] for r in roles],
                [v[r] for r in roles],
                [],
                group.steps,
                fused=True,
                beta1=beta1,
                beta2=beta2,
                **hyper,
            )

    def _group_of(self, p: nn.Parameter) -> int:
        return next(i for i, g in enumerate(self.optimizer.param_groups) if any(q is p for q in g["params"]))

    def _advance_step(self, p: nn.Parameter) -> Tensor:
        """The parameter's step count before this step (for the update, which advances its own copy),
        advanced in the optimizer's state now, as in-memory training's step advances it."""
        state = self.optimizer.state[p]
        if "step" not in state:  # NOTE: the fused AdamW's own first step: a float32 scalar count
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        before = state["step"].clone()
        torch._foreach_add_([state["step"]], 1)  # NOTE: as the fused AdamW adds it: the same float32 bits
        return before
