"""The dispatcher seam: what the MoE layer asks of any dispatcher, and of the experts it hands over.

A dispatcher takes the router's assignments and returns the combined output in one call
(``apply``), not as separate dispatch and combine steps, because expert parallelism with overlap
interleaves them chunk by chunk with the expert computation.

Legend: T tokens, D model dim, R rows (assignments), E experts.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from moekit.dispatch.local import DispatchMeta
from moekit.experts.grouped import Schedule
from moekit.routing import RouterOutput


class ScheduledExperts(Protocol):
    """Experts a dispatcher calls once per layer: ``experts(x, counts)`` or ``experts(x, schedule=s)``
    (``s(x, ffn)`` runs the FFN on as many row groups as it likes inside the one call)."""

    def __call__(
        self, x_RD: Tensor, tokens_per_expert: Tensor | None = None, *, schedule: Schedule | None = None
    ) -> Tensor: ...


class Dispatcher(Protocol):
    """Routes rows to their experts, has them computed and combines the outputs."""

    def apply(self, x_TD: Tensor, routing: RouterOutput, experts: ScheduledExperts) -> tuple[Tensor, DispatchMeta]:
        """y [T, D] = sum over each token's assignments of weight x expert(x); plus the meta
        (per-expert counts routed and kept) the layer's statistics read."""
        ...
