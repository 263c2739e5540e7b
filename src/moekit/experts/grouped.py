"""Routed experts with stacked weights: one grouped GEMM per weight matrix.

Legend: R rows sorted by expert, D model dim, F expert hidden dim, E experts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.experts.gemm import grouped_matmul, records_grad

ExpertsFn = Callable[[Tensor, Tensor], Tensor]  # (rows grouped by expert, rows per expert) -> outputs
Schedule = Callable[[Tensor, ExpertsFn], Tensor]  # (rows, the experts' FFN) -> outputs, calling it any number of times


def local_tensor(w: Tensor) -> Tensor:
    """This rank's experts when expert parallelism made ``w`` a DTensor sharded over experts.

    No tensor is a DTensor before ``torch.distributed.tensor`` is imported (expert parallelism imports
    it), so a single-device model never loads that package (seconds of ``import moekit``)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return w.to_local() if dtensor is not None and isinstance(w, dtensor.DTensor) else w


def draw_normal_(p: Tensor, std: float) -> Tensor:
    """``nn.init.normal_(p, std=std)``; returns the values drawn. A tensor on the meta device (a weight
    kept outside the module, such as offloaded training's experts) draws the same numbers into a new
    tensor on the default device, so the generator's stream goes on as it would with storage and every
    later draw is the same (under ``torch.device("meta")``, a model built whole on meta, none is drawn)."""
    if not p.is_meta:
        return nn.init.normal_(p, std=std)
    if torch.get_default_device().type == "meta":  # nothing can be drawn (meta's normal_ only costs time)
        return p
    return torch.empty(p.shape, dtype=p.dtype).normal_(0.0, std)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the expert matmuls run in: autocast's if it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` over a fused ``[..., 2F]`` input (gate first).

    The backward writes both halves of one ``[..., 2F]`` gradient in place, instead of autograd's
    separate gradients and a concatenation; ``silu(gate)`` is kept from the forward rather than
    recomputed. Each saved pass over these, the largest activations, is measurable on CPU.
    """

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        silu_gate = F.silu(gate)
        ctx.save_for_backward(h, silu_gate)
        return silu_gate * up

    @staticmethod
    def backward(ctx, d_out: Tensor) -> Tensor:
        h, silu_gate = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        d_h = torch.empty_like(h)
        d_gate, d_up = d_h.chunk(2, dim=-1)
        torch.mul(d_out, silu_gate, out=d_up)
        torch.ops.aten.silu_backward.grad_input(d_out * up, gate, grad_input=d_gate)
        return d_h


def clamped_swiglu(h_RX: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's expert activation over a fused ``[..., 2F]`` input (gate first): the gate clamped
    above at ``limit``, up to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = h_RX.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


@dataclass(frozen=True)
class Activation:
    """An expert FFN's nonlinearity: swiglu (gated SiLU), gelu, or clamped_swiglu with its constants."""

    name: str = "swiglu"
    alpha: float = 1.702  # clamped_swiglu only
    limit: float = 7.0  # clamped_swiglu only

    @property
    def gated(self) -> bool:
        """Whether the input projection holds a gate and an up half (``2F`` wide)."""
        return self.name != "gelu"

    def __call__(self, h_RX: Tensor) -> Tensor:
        if self.name == "swiglu":
            if not records_grad(h_RX):  # the same arithmetic as ``_SwiGLU.forward``, without its overhead
                gate, up = h_RX.chunk(2, dim=-1)
                return F.silu(gate) * up
            return _SwiGLU.apply(h_RX)
        if self.name == "clamped_swiglu":
            return clamped_swiglu(h_RX, self.alpha, self.limit)
        return F.gelu(h_RX)


def apply_activation(h_RX: Tensor, activation: Activation) -> Tensor:
    """SwiGLU: silu(gate) * up, with gate and up fused side by side in one GEMM output; GELU; or gpt-oss's."""
    return activation(h_RX)


@dataclass(frozen=True)
class ExpertCompute:
    """What an expert computes around its two matmuls: ``act(x @ w_in + b_in) @ w_out + b_out``.

    The matmuls are given, so the grouped resident path, the per-token reference and the offloaded
    path (matmuls of a cached, maybe quantized, expert) share the rest of the arithmetic.
    """

    activation: Activation
    bias_in: Tensor | None = None  # [E, 2F or F]
    bias_out: Tensor | None = None  # [E, D]

    def __call__(
        self, x_RD: Tensor, matmul_in: Callable[[Tensor], Tensor], matmul_out: Callable[[Tensor], Tensor], experts
    ) -> Tensor:
        """``experts``: the expert of all rows (an int), or rows per expert ``[E]`` (rows grouped by expert)."""
        h = matmul_in(x_RD)
        if self.bias_in is not None:
            h = h + _per_row(self.bias_in, experts, h)
        y = matmul_out(self.activation(h))
        if self.bias_out is not None:
            y = y + _per_row(self.bias_out, experts, y)
        return y


def _per_row(bias_EX: Tensor, experts: int | Tensor, like_RX: Tensor) -> Tensor:
    if isinstance(experts, int):
        return bias_EX[experts].to(like_RX.dtype)
    return bias_EX.to(like_RX.dtype).repeat_interleave(experts, dim=0, output_size=like_RX.shape[0])


class GroupedExperts(nn.Module):
    """E expert FFNs stored as ``w_in [E, D, F or 2F]`` and ``w_out [E, F, D]`` (with ``bias``, also
    ``w_in_bias [E, F or 2F]`` and ``w_out_bias [E, D]``).

    Weights are laid out [in, out] so each expert's matmul is ``x @ w[e]``, the layout
    ``torch._grouped_mm`` takes. For SwiGLU the gate and up projections are fused in ``w_in``
    (gate first), so the first layer is one grouped GEMM, not two.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        activation: Activation | str = "swiglu",
        gemm: str = "auto",
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        """``device="meta"``: built without storage, the weights kept elsewhere (``draw_normal_``)."""
        super().__init__()
        self.activation = Activation(activation) if isinstance(activation, str) else activation
        self.gemm = gemm
        width_in = 2 * d_ff if self.activation.gated else d_ff
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, width_in, device=device))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_ff, d_model, device=device))
        self.w_in_bias = nn.Parameter(torch.zeros(num_experts, width_in, device=device)) if bias else None
        self.w_out_bias = nn.Parameter(torch.zeros(num_experts, d_model, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        draw_normal_(self.w_in, std=self.w_in.shape[1] ** -0.5)
        draw_normal_(self.w_out, std=self.w_out.shape[1] ** -0.5)
        for bias in (self.w_in_bias, self.w_out_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    @property
    def num_experts(self) -> int:
        return self.w_in.shape[0]

    def forward(
        self, x_RD: Tensor, tokens_per_expert: Tensor | None = None, *, schedule: Schedule | None = None
    ) -> Tensor:
        """Rows grouped by expert in order -> outputs; ``tokens_per_expert`` counts this module's experts.

        With ``schedule``, returns ``schedule(x_RD, ffn)``: overlapped dispatch runs the FFN chunk by
        chunk inside this one call, so that FSDP gathers sharded experts once per pass, not per chunk.
        """
        w_in, w_out = local_tensor(self.w_in), local_tensor(self.w_out)
        biases = [local_tensor(b) if b is not None else None for b in (self.w_in_bias, self.w_out_bias)]

        def ffn(rows_RD: Tensor, counts_E: Tensor) -> Tensor:
            return expert_ffn(rows_RD, w_in, w_out, counts_E, self.activation, self.gemm, *biases)

        if schedule is not None:
            return schedule(x_RD, ffn)
        assert tokens_per_expert is not None, "tokens_per_expert or a schedule"
        return ffn(x_RD, tokens_per_expert)


def expert_ffn(
    x_RD: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    tokens_per_expert: Tensor,
    activation: Activation,
    gemm: str,
    bias_in: Tensor | None = None,
    bias_out: Tensor | None = None,
) -> Tensor:
    """The FFN of stacked experts over rows grouped by expert (also run on replicated shadow experts)."""
    dtype = compute_dtype(x_RD)
    w_in, w_out = w_in.to(dtype), w_out.to(dtype)
    return ExpertCompute(activation, bias_in, bias_out)(
        x_RD.to(dtype),
        lambda x: grouped_matmul(x, w_in, tokens_per_expert, gemm),
        lambda h: grouped_matmul(h, w_out, tokens_per_expert, gemm),
        tokens_per_expert,
    )


class DenseFFN(nn.Module):
    """A plain FFN with the same activation choices (shared experts, residual MLP, dense layers).

    SwiGLU keeps its gate and up projections apart (``w_gate``, ``w_in``) so that tensor parallelism
    can split each by rows.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu") -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False) if activation == "swiglu" else None
        self.w_in = nn.Linear(d_model, d_ff, bias=False)
        self.w_out = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.w_in(x)
        h = F.silu(self.w_gate(x)) * h if self.w_gate is not None else F.gelu(h)
        return self.w_out(h)
