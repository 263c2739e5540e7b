"""Causal scaled dot-product attention with what model families add to it: sliding windows, left
padding, and attention sinks, all on ``F.scaled_dot_product_attention`` (its fused kernels, its
backward).

Legend: B batch, H query heads, G key/value heads, L queries, S keys, d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moekit.experts.matmul import SIXTEEN_BIT, native_16bit
from moekit.kernels import one_query_bf16, one_query_takes


def causal_mask(
    start: int, num_queries: int, num_keys: int, window: int, left_pad_B: Tensor | None, device: torch.device
) -> Tensor | None:
    """``[B or 1, 1, L, S]`` (or ``[L, S]``) boolean mask for queries at positions ``start..`` over keys
    at ``0..S-1``; None where each query sees every key up to its own and no other is hidden: plain
    causal attention from position 0, or one query at the last position (a decode step).

    ``window`` > 0: a query sees only the ``window`` most recent keys, its own included (Mistral,
    gpt-oss). ``left_pad_B``: leading padding positions of each row, seen by no real token.
    """
    if (start == 0 or num_queries == 1) and left_pad_B is None and not window:
        return None
    key_pos = torch.arange(num_keys, device=device)
    query_pos = (start + torch.arange(num_queries, device=device)).unsqueeze(1)
    mask = key_pos <= query_pos  # [L, S]
    if window:
        mask = mask & (key_pos > query_pos - window)
    if left_pad_B is None:
        return mask
    # NOTE: a padding query still sees itself, so its row stays finite (no 0/0 softmax).
    real = key_pos >= left_pad_B.view(-1, 1, 1, 1)
    return mask & (real | (key_pos == query_pos))


def attend(
    q_BHLd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask: Tensor | None, sinks_H: Tensor | None, dropout: float
) -> Tensor:
    """Attention output ``[B, H, L, d]``; ``mask`` None: causal, queries the last L of the S positions
    (``causal_mask``'s None: L == S, or one query seeing every key).

    ``sinks_H``: a learned logit per head that joins each softmax's denominator and no numerator
    (gpt-oss), so a head may put weight on nothing. It is computed as one extra key every query
    sees, with a zero value: an extra coordinate holds ``sink / scale`` in the queries and 1 in that
    key (0 in the real keys), so its score is exactly the sink, its gradient reaching the sinks.
    """
    L, S, d = q_BHLd.shape[2], k_BGSd.shape[2], q_BHLd.shape[-1]
    scale = d**-0.5
    gqa = q_BHLd.shape[1] != k_BGSd.shape[1]
    cpu = q_BHLd.device.type == "cpu"
    if L == 1 and sinks_H is None and not dropout and cpu and not torch.is_grad_enabled():
        return one_query(q_BHLd, k_BGSd, v_BGSd, mask, scale)
    if cpu and q_BHLd.dtype in SIXTEEN_BIT and not native_16bit(q_BHLd.dtype):
        # NOTE: SDPA's kernels accumulate in fp32 anyway; without native 16-bit kernels (fp16 on most
        # CPUs) they convert block by block: fp16, 512 positions, 16 heads over 4 groups, 2 threads,
        # 17.7 ms against 6.5 converted once (the bf16 and fp32 kernels' 6.4-6.5).
        y = attend(q_BHLd.float(), k_BGSd.float(), v_BGSd.float(), mask, sinks_H, dropout)
        return y.to(q_BHLd.dtype)
    if sinks_H is None:
        if mask is None:
            # NOTE: SDPA aligns is_causal's mask top-left: right only for L == S; one query sees every key
            return F.scaled_dot_product_attention(
                q_BHLd, k_BGSd, v_BGSd, is_causal=L > 1, dropout_p=dropout, enable_gqa=gqa
            )
        return F.scaled_dot_product_attention(q_BHLd, k_BGSd, v_BGSd, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
    B, H = q_BHLd.shape[:2]
    if mask is None:
        mask = torch.ones(L, S, dtype=torch.bool, device=q_BHLd.device).tril(S - L)
    sink_q = (sinks_H / scale).to(q_BHLd.dtype).view(1, H, 1, 1).expand(B, H, L, 1)
    q = torch.cat([q_BHLd, sink_q], dim=-1)
    sink_key = k_BGSd.new_zeros(*k_BGSd.shape[:2], 1, d + 1)
    sink_key[..., -1] = 1
    k = torch.cat([F.pad(k_BGSd, (0, 1)), sink_key], dim=2)
    v = F.pad(v_BGSd, (0, 0, 0, 1))  # the sink's value: zeros
    mask = F.pad(mask, (0, 1), value=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa, scale=scale)


def one_query(q_BH1d: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Decoding's attention on a CPU, one query per sequence: each key/value group's queries against its
    keys as two batched matmuls, the scores and softmax in fp32, the weights times the values in fp32
    or, for many bf16 values, in bf16 with fp32 sums (as SDPA's CPU kernels compute), the result
    rounded to the inputs' dtype.

    NOTE: SDPA's CPU kernels pay per (sequence, head) block: bf16, 16 heads over 4 groups, one thread,
    16 sequences of 64 positions 1.27 ms against 0.18 ms here, 64 of 128 12.7 against 3.0 ms, 64 of 512
    58.1 against 16.6 ms (``benchmarks/measured/cpu-matmul.json``, ``python benchmarks/cpu_matmul.py``).
    ``mask`` ``[B or 1, 1, 1, S]``; None: every key is visible (the query is the last position).

    NOTE: keys and values of several sequences that need converting to fp32 or reordering are done a few
    sequences at a time, ``CONVERTED_BYTES`` at most (but a whole sequence): a larger fresh tensor comes
    from an mmap of its own (glibc serves every block over 32 MB so) and pays its page faults at every
    layer of every step (a serving step's attention, bf16, 64 sequences of 512 positions, 2 threads:
    25.4 ms a layer at once, 8.4 in chunks; ``python benchmarks/cpu_matmul.py``'s paged step before and
    after the chunks).
    """
    B, G, S, d = k_BGSd.shape
    if B == 1 and mask is None and one_query_takes(q_BH1d[0, :, 0], k_BGSd[0], v_BGSd[0]):
        # one sequence's bf16 keys and values read in place by moekit's kernel: 3.5-5.3x faster a layer
        return one_query_bf16(q_BH1d[0, :, 0], k_BGSd[0], v_BGSd[0], scale).view(1, -1, 1, d)
    # NOTE: the weights times bf16 values in bf16 (the softmax rounded to bf16, sums in fp32, as SDPA's
    # own CPU kernel computes) from PV_16BIT_FROM values of several sequences on, where the CPU has
    # native bf16 kernels: the values are not converted (a serving step's attention, 2 threads, a layer:
    # 64 sequences of 128 positions 0.94-1.01 ms against 1.48-1.49, of 512 6.86-6.93 against 7.21-7.37;
    # but one of 64 0.089-0.094 against 0.070-0.076: cpu_matmul.py's paged step). Not one sequence (its
    # one-token forward turns oneDNN off, leaving ATen's slow bf16 loop), not fp16 (its rounding makes
    # small normalised weights subnormal). Decided once for the call, so no sequence's sums depend on
    # the chunk it lands in.
    several_bf16 = v_BGSd.dtype == torch.bfloat16 and B > 1 and v_BGSd.numel() >= PV_16BIT_FROM
    pv = torch.bfloat16 if several_bf16 and native_16bit(torch.bfloat16) else torch.float32
    as_is = k_BGSd.dtype == torch.float32 and all(t.transpose(0, 1).is_contiguous() for t in (k_BGSd, v_BGSd))
    per_chunk = B if as_is else max(1, CONVERTED_BYTES // (G * S * d * 4))
    if B == 1 or per_chunk >= B:
        return _one_query(q_BH1d, k_BGSd, v_BGSd, mask, scale, pv)
    chunks = [slice(b, b + per_chunk) for b in range(0, B, per_chunk)]
    masks = [mask if mask is None or mask.shape[0] == 1 else mask[c] for c in chunks]
    parts = [_one_query(q_BH1d[c], k_BGSd[c], v_BGSd[c], m, scale, pv) for c, m in zip(chunks, masks, strict=True)]
    return torch.cat(parts)


CONVERTED_BYTES = 16 << 20  # one_query's keys or values converted or reordered at once, at most (a sequence at least)
PV_16BIT_FROM = 1 << 20  # bf16 values from which one_query multiplies them in bf16 (see its NOTE)


def _one_query(
    q_BH1d: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask: Tensor | None, scale: float, pv: torch.dtype
) -> Tensor:
    """``one_query`` for sequences converted at once; ``pv``: the dtype the weights times values take."""
    B, H, _, d = q_BH1d.shape
    G, S = k_BGSd.shape[1], k_BGSd.shape[2]
    Q = H // G
    if B == 1:  # one sequence: its keys and values are [G, S, d] already, copied contiguous as below
        q = q_BH1d.reshape(G, Q, d).float()
        k, v = _group_major(k_BGSd[0], torch.float32), _group_major(v_BGSd[0], pv)
    else:
        # [G, B] leading, so that each (group, sequence) is one matrix of a batch of G * B: keys and
        # values laid out so already (the paged cache's gather) are only converted, others reordered too
        q = q_BH1d.reshape(B, G, Q, d).transpose(0, 1).reshape(G * B, Q, d).float()
        k = _group_major(k_BGSd.transpose(0, 1), torch.float32).view(G * B, S, d)
        v = _group_major(v_BGSd.transpose(0, 1), pv).view(G * B, S, d)
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale).view(G, B, Q, S)
    if mask is not None:
        scores = scores.masked_fill_(~mask.view(1, -1, 1, S), float("-inf"))
    out = torch.bmm(scores.softmax(dim=-1).view(G * B, Q, S).to(pv), v)
    return out.view(G, B, Q, d).transpose(0, 1).reshape(B, H, 1, d).to(q_BH1d.dtype)


def _group_major(t_GBSd: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, contiguous: as it is, or converted, where it is contiguous; else one copy."""
    if t_GBSd.is_contiguous():
        return t_GBSd.to(dtype)
    return torch.empty(t_GBSd.shape, dtype=dtype, device=t_GBSd.device).copy_(t_GBSd)
