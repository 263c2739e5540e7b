"""The choice of expert GEMM backend."""

from __future__ import annotations

import torch

from moekit.experts.gemm import has_grouped_mm, resolve_backend


def test_auto_gemm_is_the_documented_cpu_rule() -> None:
    """``auto`` is a fixed rule, not a measurement: grouped_mm to train, per-expert matmuls to infer."""
    w = torch.randn(4, 8, 8, requires_grad=True)
    x = torch.randn(10, 8)
    assert resolve_backend("auto", x, w) == ("grouped_mm" if has_grouped_mm() else "per_expert_mm")
    with torch.no_grad():
        assert resolve_backend("auto", x, w) == "per_expert_mm"
    assert resolve_backend("auto", x.double(), w.double()) == "per_expert_mm"
    assert resolve_backend("per_expert_mm", x, w) == "per_expert_mm"
