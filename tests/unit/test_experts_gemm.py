"""The choice of expert GEMM backend, and identity wrappers that must not return views."""

from __future__ import annotations

import pytest
import torch

from moekit.experts.gemm import grouped_matmul, has_grouped_mm, resolve_backend
from moekit.parallel.pp import _AttachAuxLoss


def test_auto_gemm_is_the_documented_cpu_rule() -> None:
    """``auto`` is a fixed rule, not a measurement: grouped_mm to train, per-expert matmuls to infer."""
    w = torch.randn(4, 8, 8, requires_grad=True)
    x = torch.randn(10, 8)
    assert resolve_backend("auto", x, w) == ("grouped_mm" if has_grouped_mm() else "per_expert_mm")
    with torch.no_grad():
        assert resolve_backend("auto", x, w) == "per_expert_mm"
    assert resolve_backend("auto", x.double(), w.double()) == "per_expert_mm"
    assert resolve_backend("per_expert_mm", x, w) == "per_expert_mm"


def test_grouped_mm_output_is_no_view_and_takes_zero_stride_gradients() -> None:
    """FSDP2 warns when a sharded module returns a view; ``y.sum().backward()`` hands grouped_mm's CPU
    backward a gradient with zero strides. Gradients checked against one matmul per expert."""
    if not has_grouped_mm():
        pytest.skip("torch._grouped_mm is missing")
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5])
    x = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(3, 4, 8, requires_grad=True)
    y = grouped_matmul(x, w, counts, "grouped_mm")
    assert not y._is_view()
    y.sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rows = torch.repeat_interleave(torch.arange(3), counts)
    torch.stack([x_ref[i] @ w_ref[e] for i, e in enumerate(rows.tolist())]).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_attached_aux_loss_returns_no_view_and_feeds_the_loss_its_gradient() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    aux = torch.tensor(0.5, requires_grad=True)
    out = _AttachAuxLoss.apply(x, aux * 2, 0.25)
    assert not out._is_view()
    (3 * out).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    torch.testing.assert_close(aux.grad, torch.tensor(0.5))  # d(2 aux)/d aux times the given 0.25
