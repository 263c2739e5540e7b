"""Grouped GEMM: rows of x sorted by expert, each group multiplied by its own expert's weight.

Legend: R rows (sorted by expert), K input dim, N output dim, E experts.

Two implementations of the same op; ``gemm="auto"`` picks one by a fixed rule (``resolve_backend``):
- ``grouped_mm``: ``torch._grouped_mm``, one call for all experts (a kernel on Hopper GPUs, a C++
  loop of matmuls on CPU).
- ``per_expert_mm``: one ``torch.mm`` per expert into preallocated slices, with a hand-written
  backward; the fallback where ``torch._grouped_mm`` is missing. Autograd over weight slices
  (``w[e]``) would materialise a full-size zero gradient per expert; the custom backward writes
  each expert's gradient once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moekit.experts.matmul import mm


def per_expert_mm(x_RK: Tensor, w_EKN: Tensor, counts: list[int]) -> Tensor:
    """One matmul per expert that received rows, into slices of one output (``matmul.mm``: the CPU's
    kernel choice for 16-bit weights)."""
    y_RN = x_RK.new_empty(x_RK.shape[0], w_EKN.shape[2])
    for e, rows in _expert_slices(counts):
        mm(x_RK[rows], w_EKN[e], out=y_RN[rows])
    return y_RN


class _PerExpertMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RK: Tensor, w_EKN: Tensor, counts: list[int]) -> Tensor:
        y_RN = per_expert_mm(x_RK, w_EKN, counts)
        ctx.save_for_backward(x_RK, w_EKN)
        ctx.counts = counts
        return y_RN

    @staticmethod
    def backward(ctx, dy_RN: Tensor):
        x_RK, w_EKN = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()
        dx = torch.empty_like(x_RK) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(w_EKN) if ctx.needs_input_grad[1] else None
        if dw is not None:
            # NOTE: only idle experts need zeros; filling the whole [E, K, N] costs as much as a GEMM.
            for e, n in enumerate(ctx.counts):
                if n == 0:
                    dw[e].zero_()
        for e, rows in _expert_slices(ctx.counts):
            if dx is not None:
                torch.mm(dy_RN[rows], w_EKN[e].t(), out=dx[rows])
            if dw is not None:
                torch.mm(x_RK[rows].t(), dy_RN[rows], out=dw[e])
        return dx, dw, None


def _expert_slices(counts: list[int]):
    """(expert, row slice) for every expert that received rows."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
        start += n


def _contiguous(grad: Tensor) -> Tensor:
    """Gradient hook for ``torch._grouped_mm``'s output.

    NOTE: torch 2.13's CPU backward of ``torch._grouped_mm`` rejects gradients with zero strides,
    which is what ``y.sum().backward()`` produces. A hook, not an identity autograd.Function: the
    Function's output would be a view, which FSDP2 warns about on a sharded module's output.
    """
    return grad.contiguous()


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def records_grad(*tensors: Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` here (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def resolve_backend(backend: str, x: Tensor, w: Tensor) -> str:
    """The grouped GEMM ``auto`` stands for: a fixed rule on device, dtype and grad mode.

    - CPU: ``torch._grouped_mm`` when gradients are needed, per-expert matmuls when not.
    - CUDA: ``torch._grouped_mm`` in bf16 on compute capability 9.0+, per-expert matmuls elsewhere.
    - No ``torch._grouped_mm``, or a dtype it does not take: per-expert matmuls.

    Nothing is measured at run time. ``benchmarks/moe_layer.py`` prints, for each of its shapes and
    passes, what ``auto`` picks and the other backend's speed relative to it, round by round; the
    CUDA rule follows where the grouped kernel was written for.
    """
    if backend != "auto":
        return backend
    if not has_grouped_mm() or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "per_expert_mm"
    if x.device.type == "cuda":
        hopper = torch.cuda.get_device_capability(x.device) >= (9, 0)
        return "grouped_mm" if hopper and x.dtype == torch.bfloat16 else "per_expert_mm"
    return "grouped_mm" if records_grad(x, w) else "per_expert_mm"


def grouped_matmul(x_RK: Tensor, w_EKN: Tensor, tokens_per_expert: Tensor, backend: str = "auto") -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e] for every expert e; rows are grouped by expert in order."""
    backend = resolve_backend(backend, x_RK, w_EKN)
    if backend == "grouped_mm":
        if not has_grouped_mm():
            raise RuntimeError("gemm='grouped_mm' needs torch._grouped_mm (torch >= 2.8); use gemm='auto'")
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        y_RN = torch._grouped_mm(x_RK, w_EKN, offs=offsets)
        if y_RN.requires_grad:
            y_RN.register_hook(_contiguous)
        return y_RN
    assert backend == "per_expert_mm", backend
    if not records_grad(x_RK, w_EKN):  # no autograd.Function: its overhead is a share of a decode step
        return per_expert_mm(x_RK, w_EKN, tokens_per_expert.tolist())
    return _PerExpertMatmul.apply(x_RK, w_EKN, tokens_per_expert.tolist())
