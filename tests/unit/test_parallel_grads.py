"""moekit.parallel.grads on one process: the same norm and clipped gradients as torch's clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch

from moekit.parallel.grads import clip_grad_norm


def _grads(scale: float, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(16, 8, 32), (64, 32), (32,), (1,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=gen)
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: left out of the norm
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_matches_torch_clip_grad_norm(max_norm: float) -> None:
    ours, ref = _grads(3.0), _grads(3.0)
    norm = clip_grad_norm(ours, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
    for a, b in zip(ours, ref, strict=True):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in ours if p.grad is not None])
    assert clipped.item() == pytest.approx(min(max_norm, ref_norm.item()), rel=1e-5)


def test_stage_replicas_divide_the_squares() -> None:
    """A piece held by every rank of a 4-rank stage counts a quarter on each (the all-reduce sums four)."""
    params = _grads(1.0)
    single = clip_grad_norm(params, 0.0)
    shared = clip_grad_norm(params, 0.0, stage_ranks=4)
    assert shared.item() == pytest.approx(single.item() / 2, rel=1e-6)
