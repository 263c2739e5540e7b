"""Routed experts held quantized in memory: int8 or int4 weights multiplied by torch's weight-only kernels.

``moekit generate RUN --expert-format int8`` without ``--memory-budget``: every expert stays in memory,
a quarter (int8) or about an eighth (int4) of its bf16 bytes, so a memory-bound decode step reads
that much less. The formats and kernels are ``infer.quant``'s; each expert's rows are computed as the
resident and offloaded paths compute them (``ExpertCompute``), with its own quantized matmuls.

Legend: R rows sorted by expert, D model dim, E experts, K input dim, N output dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moekit.experts.grouped import ExpertCompute, GroupedExperts
from moekit.infer.quant import QUANT_FORMATS, int4_mm, int8_mm, pack_int4_for_cpu, quantize_int8


class QuantizedExperts(nn.Module):
    """The experts of one ``GroupedExperts``, quantized (``int8`` per output channel, ``int4`` in groups
    of 32); biases, when the experts have them, stay in full precision."""

    def __init__(self, experts: GroupedExperts, fmt: str) -> None:
        super().__init__()
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"expert_format={fmt!r}: choose from {', '.join(QUANT_FORMATS)}")
        self.fmt = fmt
        quantize = quantize_int8 if fmt == "int8" else pack_int4_for_cpu
        for role in ("w_in", "w_out"):
            parts = [quantize(w_KN) for w_KN in getattr(experts, role).detach()]
            self.register_buffer(f"{role}_q", torch.stack([q for q, _ in parts]))  # [E, N, K] int8 | torch's int4
            self.register_buffer(f"{role}_scale", torch.stack([s for _, s in parts]))  # [E, N] | [E, K/G, N, 2]
        self.compute = ExpertCompute(experts.activation, experts.w_in_bias, experts.w_out_bias)
        self.num_experts = experts.num_experts

    def _matmul(self, role: str, expert: int, x_MK: Tensor) -> Tensor:
        q, scale = getattr(self, f"{role}_q")[expert], getattr(self, f"{role}_scale")[expert]
        return int8_mm(x_MK, q, scale) if self.fmt == "int8" else int4_mm(x_MK, q, scale)

    def forward(self, x_RD: Tensor, tokens_per_expert: Tensor | None = None, *, schedule=None) -> Tensor:
        """Rows grouped by expert in order -> outputs, one expert at a time."""
        if schedule is not None or tokens_per_expert is None:
            raise ValueError("quantized experts compute one step's rows at once (no dispatch schedule)")
        y_RD = torch.empty_like(x_RD)
        start = 0
        for e, n in enumerate(tokens_per_expert.tolist()):
            if n:
                rows = slice(start, start + n)
                y_RD[rows] = self.compute(
                    x_RD[rows], lambda x, e=e: self._matmul("w_in", e, x), lambda h, e=e: self._matmul("w_out", e, h), e
                )
            start += n
        return y_RD


def quantize_experts_(model: nn.Module, fmt: str) -> nn.Module:
    """Swap every MoE layer's ``GroupedExperts`` for ``QuantizedExperts`` in place, one layer at a time
    (the full-precision weights of a layer are freed as its quantized ones are made)."""
    for moe in model.moe_layers():
        if fmt == "int4" and moe.experts.w_in.device.type != "cpu":
            raise ValueError("expert_format='int4': experts quantized in memory run on a CPU (torch's int4 CPU kernel)")
        if not isinstance(moe.experts, GroupedExperts):
            raise ValueError(f"expert_format={fmt!r}: the experts are already {type(moe.experts).__name__}")
        moe.experts = QuantizedExperts(moe.experts, fmt)
    return model
