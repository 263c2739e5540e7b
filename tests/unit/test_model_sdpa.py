"""Decoding's one-query attention (``model.sdpa.attend`` with one query per sequence, no grad) against
attention written out per sequence and head in float64: ``softmax(q . k / sqrt(d)) @ v`` over the
visible keys, each query head reading its group's keys (GQA). Scores up to about 30 in magnitude, as
trained models have: bf16 scores would be off by a tenth. Tolerance: fp32 1e-5; bf16 one ulp of the
largest output (its rounding) plus SDPA's own error on the same inputs."""

from __future__ import annotations

import pytest
import torch

from moekit.experts.matmul import native_16bit
from moekit.kernels import rows_available
from moekit.model import sdpa
from moekit.model.sdpa import attend

one_query_of = sdpa._one_query  # one chunk of sequences, as one_query calls it


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
@pytest.mark.parametrize(
    ("B", "H", "G", "masked"),
    [(1, 4, 4, "none"), (1, 8, 2, "each"), (3, 8, 2, "each"), (5, 6, 1, "each"), (3, 8, 2, "none"), (5, 8, 4, "all")],
)
@pytest.mark.parametrize("layout", ["group-major", "strided"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("values_in_16_bits", [False, True])
def test_one_query_attention_equals_the_written_out_softmax(
    dtype, B, H, G, masked, layout, chunked, values_in_16_bits, monkeypatch
) -> None:
    """Keys and values as the paged cache gathers them (``[G, B, S, d]`` seen as ``[B, G, S, d]``, taken
    without a copy in fp32) or laid out otherwise (``[B, S, G, d]`` seen so, reordered); ``chunked``:
    converted or reordered two sequences at a time (each chunk with its sequences' masks, or the one
    mask of all); ``values_in_16_bits``: the softmax times bf16 values of several sequences in bf16 at
    any size, as larger steps take them (CPUs with native bf16 kernels). One bf16 sequence with every key
    visible takes moekit's kernel instead where it runs (the next test)."""
    if values_in_16_bits and not (dtype == torch.bfloat16 and B > 1 and native_16bit(torch.bfloat16)):
        pytest.skip("bf16 values of several sequences on a CPU with native bf16 kernels take that path")
    gen = torch.Generator().manual_seed(B * H + G)
    S, d = 11, 64
    calls = []
    monkeypatch.setattr(sdpa, "_one_query", lambda *a: calls.append((a[0].shape[0], a[5])) or one_query_of(*a))
    if chunked:
        monkeypatch.setattr(sdpa, "CONVERTED_BYTES", 2 * G * S * d * 4)
    if values_in_16_bits:
        monkeypatch.setattr(sdpa, "PV_16BIT_FROM", 0)
    q = (3 * torch.randn(B, H, 1, d, generator=gen)).to(dtype)
    if layout == "group-major":
        k, v = ((f * torch.randn(G, B, S, d, generator=gen)).to(dtype).transpose(0, 1) for f in (3, 1))
    else:
        k, v = ((f * torch.randn(B, S, G, d, generator=gen)).to(dtype).transpose(1, 2) for f in (3, 1))
    mask = None
    if masked != "none":
        mask = torch.rand(B if masked == "each" else 1, 1, 1, S, generator=gen) > 0.4
        mask[..., -1] = True  # the query's own position
    with torch.no_grad():
        got = attend(q, k, v, mask, None, 0.0)
    ref = _reference(q, k, v, mask)
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=G != H)
    sdpa_err = float((torch_sdpa.double() - ref).abs().amax())
    tol = 1e-5 if dtype == torch.float32 else 2.0**-8 * float(ref.abs().amax()) + sdpa_err
    assert got.shape == (B, H, 1, d) and got.dtype == dtype
    assert float((got.double() - ref).abs().amax()) <= tol
    as_is = dtype == torch.float32 and (layout == "group-major" or G == 1)  # one group: group-major either way
    if dtype == torch.bfloat16 and B == 1 and mask is None and rows_available():
        assert calls == [], "one bf16 sequence seeing every key: moekit's kernel"
        return
    assert [n for n, _ in calls] == ([2] * (B // 2) + [B % 2] * (B % 2) if chunked and B > 1 and not as_is else [B])
    assert {pv for _, pv in calls} == {torch.bfloat16 if values_in_16_bits else torch.float32}


@pytest.mark.parametrize(
    ("H", "G", "S", "d"),
    [(4, 4, 1, 64), (8, 2, 17, 64), (16, 4, 300, 64), (6, 1, 33, 128), (2, 2, 5, 32), (4, 2, 16, 64)],
)
def test_one_sequences_attention_through_the_kernel_equals_the_written_out_softmax(
    H: int, G: int, S: int, d: int, monkeypatch, kernel_isa: str
) -> None:
    """The kernel's path (one bf16 sequence, every key visible) over keys and values as a contiguous cache
    holds them (``[1, G, max_len, d]`` seen to ``S`` positions, position and group strides of their own):
    within half a bf16 unit of the output plus SDPA's own error of the float64 softmax written out per
    head, in each build this CPU runs; 300 and 17 positions take the softmax's 16- and 8-wide tails (the
    AVX-512 and AVX2 builds'), 16 none (the NaN below lands in the main loops), 128 dims the kernel's
    widest rows. A NaN key
    makes its head's output NaN, as torch's path does, and no other head's."""
    gen = torch.Generator().manual_seed(H * S + d)
    calls = []
    monkeypatch.setattr(sdpa, "_one_query", lambda *a: calls.append(a) or one_query_of(*a))
    q = torch.randn(1, H, 1, d, generator=gen).bfloat16()  # scores of a few units: a wrong scale shows
    k, v = ((f * torch.randn(1, G, S + 7, d, generator=gen)).bfloat16()[:, :, :S] for f in (3, 1))
    assert G == 1 or not k.is_contiguous()  # one group: a prefix of its positions is contiguous
    with torch.no_grad():
        got = attend(q, k, v, None, None, 0.0)
    ref = _reference(q, k, v, None)
    sdpa_err = float(
        (torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=G != H).double() - ref).abs().amax()
    )
    assert got.shape == (1, H, 1, d) and got.dtype == torch.bfloat16 and calls == [], "the kernel, not torch's path"
    assert float((got.double() - ref).abs().amax()) <= 2.0**-8 * float(ref.abs().amax()) + sdpa_err
    k[0, 0, S - 1, 0] = float("nan")  # group 0's last key: its heads' scores
    with torch.no_grad():
        nan = attend(q, k, v, None, None, 0.0)[0, :, 0].isnan().any(dim=-1)
    assert nan.tolist() == [h < H // G for h in range(H)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 4])
def test_16_bit_prefill_attention_equals_the_written_out_softmax(dtype, window: int) -> None:
    """Many queries in 16 bits (fp16 without native kernels is computed in fp32 and rounded once): within
    one ulp of the largest output of the float64 causal softmax, each query over the keys up to its own
    position (the ``window`` latest, when > 0)."""
    from moekit.model.sdpa import causal_mask

    gen = torch.Generator().manual_seed(window)
    B, H, G, L, d = 2, 8, 2, 12, 64
    q = (3 * torch.randn(B, H, L, d, generator=gen)).to(dtype)
    k, v = ((f * torch.randn(B, G, L, d, generator=gen)).to(dtype) for f in (3, 1))
    mask = causal_mask(0, L, L, window, None, q.device)
    with torch.no_grad():
        got = attend(q, k, v, mask, None, 0.0)
    ref = torch.zeros(B, H, L, d, dtype=torch.float64)
    for i in range(L):
        visible = [s <= i if mask is None else bool(mask[i, s]) for s in range(L)]
        assert visible == [s <= i and (not window or s > i - window) for s in range(L)]
        ref[:, :, i : i + 1] = _reference(q[:, :, i : i + 1], k, v, torch.tensor(visible).view(1, 1, 1, L))
    assert got.shape == (B, H, L, d) and got.dtype == dtype
    eps = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    assert float((got.double() - ref).abs().amax()) <= eps * float(ref.abs().amax())


@pytest.mark.parametrize("grad", [False, True])
def test_a_decode_step_needs_no_mask_and_sees_every_key(grad: bool) -> None:
    """``causal_mask`` gives None for one query past the start (no window, no padding), and ``attend``
    reads None as every key visible on both of its paths: the one-query kernels, and SDPA (with grad),
    whose ``is_causal`` would show that query the first key only."""
    from moekit.model.sdpa import causal_mask

    assert causal_mask(6, 1, 7, 0, None, torch.device("cpu")) is None
    assert causal_mask(6, 1, 7, 3, None, torch.device("cpu")) is not None  # a window hides keys
    assert causal_mask(5, 2, 7, 0, None, torch.device("cpu")) is not None
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, n, 16, generator=gen) for n in (1, 7, 7))
    with torch.set_grad_enabled(grad):
        got = attend(q.requires_grad_(grad), k, v, None, None, 0.0)
    assert float((got.double() - _reference(q.detach(), k, v, None)).abs().amax()) <= 1e-5
