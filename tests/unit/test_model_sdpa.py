"""Decoding's one-query attention (``model.sdpa.attend`` with one query per sequence, no grad) against
attention written out per sequence and head in float64: ``softmax(q . k / sqrt(d)) @ v`` over the
visible keys, each query head reading its group's keys (GQA). Tolerance: fp32 1e-5; bf16 two ulps of
the output (the scores are rounded to bf16 before the softmax)."""

from __future__ import annotations

import pytest
import torch

from moekit.model.sdpa import attend


def _reference(q, k, v, mask):
    B, H, _, d = q.shape
    G, S = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, 1, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            visible = [s for s in range(S) if mask is None or bool(mask[b if mask.shape[0] > 1 else 0, 0, 0, s])]
            scores = torch.stack([q[b, h, 0].double() @ k[b, g, s].double() for s in visible]) / d**0.5
            weights = torch.softmax(scores, dim=0)
            out[b, h, 0] = sum(w * v[b, g, s].double() for w, s in zip(weights, visible, strict=True))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "H", "G", "masked"), [(1, 4, 4, False), (3, 8, 2, True), (5, 6, 1, True)])
def test_one_query_attention_equals_the_written_out_softmax(dtype, B, H, G, masked) -> None:
    gen = torch.Generator().manual_seed(B * H + G)
    S, d = 11, 16
    q = torch.randn(B, H, 1, d, generator=gen).to(dtype)
    # keys and values as the paged cache gathers them: [B, S, G, d] seen as [B, G, S, d]
    k, v = (torch.randn(B, S, G, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    mask = None
    if masked:
        mask = torch.rand(B, 1, 1, S, generator=gen) > 0.4
        mask[..., -1] = True  # the query's own position
    with torch.no_grad():
        got = attend(q, k, v, mask, None, 0.0)
    ref = _reference(q, k, v, mask)
    tol = 1e-5 if dtype == torch.float32 else 2 * 2.0**-8 * float(ref.abs().amax())
    assert got.shape == (B, H, 1, d) and got.dtype == dtype
    assert float((got.double() - ref).abs().amax()) <= tol
