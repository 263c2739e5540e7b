"""An MoE layer's experts whose weights live in the working set, not in the module.

``OffloadedExperts`` takes the place of a ``GroupedExperts`` (same parameter names, so checkpoints
and the optimizer see the same model) and computes the same ``expert_ffn`` over the weights of its
layer's slot. In training, the weights enter autograd as fresh leaves aliasing the slot; the tensors
autograd saves from the slot are packed as (layer, place) instead of kept, and unpacked in backward
from the slot the layer is read into again, only the experts that computed rows if it was evicted
(``WorkingSet.route``), the lower layer being read meanwhile. When every leaf
of the layer holds its gradient, the gradients go out (``ExpertState.out``), with the rows each
expert computed in the forward (the routing, as the FFN received it), and the slot is released.
Before a forward reads a layer's slot, the layer's pending optimizer update runs on it (``settle``).

Legend: R rows sorted by expert, D model dim, E experts.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch
from torch import Tensor, nn

from moekit.experts.grouped import GroupedExperts, Schedule, expert_ffn
from moekit.train.offload.store import LayerFile, experts_with_rows
from moekit.train.offload.working_set import WorkingSet


class ExpertState(Protocol):
    def settle(self, upto: int | None = None) -> None:
        """Run the pending optimizer updates of layers up to ``upto``: their slots hold the new weights."""
        ...

    def out(self, layer: int, grads: dict[str, Tensor], rows_E: Tensor) -> None:
        """Take a layer's expert gradients (one micro-batch's, by role) once its backward is done, and
        the rows each expert computed (an expert with none has a zero gradient)."""
        ...


class OffloadedExperts(nn.Module):
    """``GroupedExperts`` computed from layer ``layer``'s slot of a ``WorkingSet``."""

    def __init__(self, experts: GroupedExperts, layer: int, ws: WorkingSet, file: LayerFile, sink: ExpertState):
        super().__init__()
        for name, p in experts._parameters.items():
            self.register_parameter(name, p)  # the same Parameter objects, in the same order
        self.activation, self.gemm = experts.activation, experts.gemm
        self.experts_count = experts.num_experts
        self.layer, self.last_layer = layer, False
        self._ws, self._file, self._sink = ws, file, sink

    @property
    def num_experts(self) -> int:
        return self.experts_count

    def forward(
        self, x_RD: Tensor, tokens_per_expert: Tensor | None = None, *, schedule: Schedule | None = None
    ) -> Tensor:
        """As ``GroupedExperts.forward``: this rank's experts over their rows, or ``schedule(x_RD, ffn)``
        (expert parallelism: the all-to-all exchange around one call of the FFN)."""
        self._sink.settle(self.layer)  # the last optimizer step's update of this layer, into its slot
        buf = self._ws.get(self.layer, +1)
        if not self.last_layer:
            self._ws.prefetch(self.layer + 1, +1)  # the next layer's weights arrive while this one computes
        try:
            weights = self._file.views(buf)
            if not torch.is_grad_enabled():
                return self._run(x_RD, tokens_per_expert, schedule, weights)
            leaves = {role: w.detach().requires_grad_() for role, w in weights.items()}
            pending = _LayerGrads(self.layer, len(leaves), self._ws, self._sink)
            for role, leaf in leaves.items():
                leaf.register_post_accumulate_grad_hook(partial(pending.add, role))
            with torch.autograd.graph.saved_tensors_hooks(partial(_pack, self.layer, buf), pending.unpack):
                return self._run(x_RD, tokens_per_expert, schedule, leaves, pending)
        finally:
            self._ws.release(self.layer)

    def _run(
        self,
        x_RD: Tensor,
        counts_E: Tensor | None,
        schedule: Schedule | None,
        w: dict[str, Tensor],
        pending: _LayerGrads | None = None,
    ) -> Tensor:
        ffn = partial(self._ffn, w=w, pending=pending)
        if schedule is not None:
            return schedule(x_RD, ffn)
        assert counts_E is not None, "tokens_per_expert or a schedule"
        return ffn(x_RD, counts_E)

    def _ffn(self, x_RD: Tensor, counts_E: Tensor, w: dict[str, Tensor], pending: _LayerGrads | None) -> Tensor:
        if pending is not None:  # the rows each expert computes (under ep, those it received), summed
            # over the calls of one forward (a schedule may run the FFN chunk by chunk): the experts
            # its backward reads
            rows_E = counts_E.to("cpu", torch.int64, copy=True)
            pending.rows_E = rows_E if pending.rows_E is None else pending.rows_E + rows_E
            self._ws.route(self.layer, experts_with_rows(pending.rows_E))
        return expert_ffn(
            x_RD, w["w_in"], w["w_out"], counts_E, self.activation, self.gemm, w.get("w_in_bias"), w.get("w_out_bias")
        )


Packed = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]  # layer, byte offset, shape, stride, dtype


def _pack(layer: int, buf_U8: Tensor, t: Tensor) -> Tensor | Packed:
    """A tensor saved for backward: the slot's weights become their place in it; the rest is kept."""
    if t.device.type != "cpu" or t.untyped_storage().data_ptr() != buf_U8.untyped_storage().data_ptr():
        return t
    offset = t.storage_offset() * t.element_size() - buf_U8.storage_offset()
    return layer, offset, tuple(t.shape), tuple(t.stride()), t.dtype


class _LayerGrads:
    """One layer's pass through backward: its weights read again on first use, its gradients collected."""

    def __init__(self, layer: int, num_leaves: int, ws: WorkingSet, sink: ExpertState) -> None:
        self.layer, self.num_leaves = layer, num_leaves
        self.ws, self.sink = ws, sink
        self.grads: dict[str, Tensor] = {}
        self.buf: Tensor | None = None
        self.rows_E: Tensor | None = None  # summed by the forward's FFN calls

    def unpack(self, packed: Tensor | Packed) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        layer, offset, shape, stride, dtype = packed
        if self.buf is None:  # first use in backward: pinned until the gradients are out
            self.buf = self.ws.get(layer, -1)
            if layer > 0:
                self.ws.prefetch(layer - 1, -1)  # backward reads the layers in reverse
        size = torch.empty((), dtype=dtype).element_size()
        base = self.buf.view(dtype)
        return base.as_strided(shape, stride, (self.buf.storage_offset() + offset) // size)

    def add(self, role: str, leaf: Tensor) -> None:
        self.grads[role] = leaf.grad
        leaf.grad = None
        if len(self.grads) < self.num_leaves:
            return
        grads, self.grads = self.grads, {}
        if self.buf is not None:
            self.buf = None
            self.ws.release(self.layer)
        assert self.rows_E is not None, "the forward ran the FFN"
        self.sink.out(self.layer, grads, self.rows_E)


def install(model: nn.Module, ws: WorkingSet, file: LayerFile, sink: ExpertState) -> list[OffloadedExperts]:
    """Swap every MoE layer's experts for ``OffloadedExperts`` (layer i: the i-th MoE layer)."""
    swapped = []
    for moe in model.moe_layers():
        experts = OffloadedExperts(moe.experts, len(swapped), ws, file, sink)
        moe.experts = experts
        swapped.append(experts)
    swapped[-1].last_layer = True
    return swapped
