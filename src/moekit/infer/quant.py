"""Quantized expert weights: fewer bytes in the slow tier, in the cache and on the wire; not less compute.

Legend: K input dim, N output dim (weights are stored [in, out], as the experts use them), G group.

- ``int8``: weight-only, one fp32 scale per output channel: ``w ~= q * scale[n]``, q in [-127, 127],
  stored [N, K] (the layout ``torch._weight_int8pack_mm`` takes). Round-trip error <= scale[n] / 2.
- ``int4``: group-wise along the input dim (G rows share a scale per output channel), symmetric
  q in [-8, 7] (scale = absmax / 7), two values packed per byte. Error per element <= scale / 2.

From fp32 experts, int8 stores ~4x fewer bytes and int4 6.4x (half a byte per weight plus an fp32 scale
per 32). The cache keeps the quantized form, so a budget holds about as many times more experts.

What this saves is bytes read and cache slots, not arithmetic: there is no integer GEMM here, and every
multiply-add runs in the compute dtype. ``matmul`` dequantizes int4 weights, and int8 ones for more than
``INT8PACK_MAX_ROWS`` rows or off the CPU, into a full-precision [K, N] weight before ``torch.mm`` (a
pass over the weight that full precision does not pay); int8 for 1-2 rows on a CPU goes through
``torch._weight_int8pack_mm``, a weight-only kernel that converts the int8 weights to the activations'
dtype inside the kernel. Quality on a trained model: ``benchmarks/quant_quality.py``.

NOTE: on CPU (torch 2.13, K=1024, N=2048, 1 thread) ``torch._weight_int8pack_mm`` took 4.6 ms for one
row against 18 ms for dequantise + ``torch.mm``, but 26 vs 20 ms for 4 rows and 174 vs 10 ms for 32:
it is used for an expert's rows up to ``INT8PACK_MAX_ROWS``, dequantise + mm above.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor

from moekit.fileio import write_atomic
from moekit.infer.expert_store import ExpertStore, Key, expert_tensor_prefix
from moekit.storage.aligned import aligned_empty

QUANT_FORMATS = ("int8", "int4")
INT4_GROUP = 32
INT8PACK_MAX_ROWS = 2
FULL_ROLES = ("w_in", "w_out")


def roles(fmt: str) -> tuple[str, ...]:
    """Tensor names of one expert in a store of format ``fmt`` (``fp`` or a QUANT_FORMATS entry)."""
    if fmt == "fp":
        return FULL_ROLES
    return tuple(f"{w}.{part}" for w in FULL_ROLES for part in ("q", "scale"))


def quantize_int8(w_KN: Tensor) -> tuple[Tensor, Tensor]:
    """int8 q [N, K] and fp32 scale [N] (per output channel, absmax / 127)."""
    w = w_KN.float().t()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def dequantize_int8(q_NK: Tensor, scale_N: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight [K, N] (a transposed view)."""
    return (q_NK.to(dtype) * scale_N.to(dtype).unsqueeze(1)).t()


def quantize_int4(w_KN: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """Packed uint8 [K/2, N] (row 2i in the low nibble, 2i+1 in the high) and fp32 scale [K/G, N]."""
    K, N = w_KN.shape
    if K % group or group % 2:
        raise ValueError(f"int4 needs the input dim ({K}) to be a multiple of the group size ({group}, even)")
    w = w_KN.float().view(K // group, group, N)
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 7
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-8, 7).to(torch.int16).view(K, N) + 8  # 0..15
    packed = (q[0::2] | (q[1::2] << 4)).to(torch.uint8)
    return packed, scale


def dequantize_int4(packed: Tensor, scale_GN: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight [K, N] in ``dtype`` (a new full-precision tensor: the work int8pack_mm avoids)."""
    half, N = packed.shape
    q = torch.empty(2 * half, N, dtype=torch.int16, device=packed.device)
    as_int = packed.to(torch.int16)
    q[0::2] = as_int & 0xF
    q[1::2] = as_int >> 4
    groups = scale_GN.shape[0]
    w = (q - 8).to(dtype).view(groups, 2 * half // groups, N) * scale_GN.to(dtype).unsqueeze(1)
    return w.view(2 * half, N)


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
DEQUANTIZERS = {"int8": dequantize_int8, "int4": dequantize_int4}


def matmul(fmt: str, views: dict[str, Tensor], role: str, x_MK: Tensor) -> Tensor:
    """``x @ w`` for weight ``role`` (w_in or w_out) of one expert stored in format ``fmt``."""
    if fmt == "fp":
        return torch.mm(x_MK, views[role].to(x_MK.dtype))
    q, scale = views[f"{role}.q"], views[f"{role}.scale"]
    small = x_MK.shape[0] <= INT8PACK_MAX_ROWS and x_MK.device.type == "cpu"
    if fmt == "int8" and small and hasattr(torch, "_weight_int8pack_mm"):
        return torch._weight_int8pack_mm(x_MK, q, scale.to(x_MK.dtype))
    return torch.mm(x_MK, DEQUANTIZERS[fmt](q, scale, x_MK.dtype))


def write_quantized_store(source: ExpertStore, path: Path, fmt: str) -> Path:
    """Quantize every expert of a full-precision store into a new safetensors file (atomic write).

    Experts are read one at a time through the store, so the full-precision weights are never all
    in memory; the quantized tensors (a quarter or less of them) are.
    """
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"expert format {fmt!r}: choose from fp, {', '.join(QUANT_FORMATS)}")
    slot = aligned_empty(source.slot_bytes)
    blocks: dict[int, list[Key]] = {}
    for block, expert in source.pieces:
        blocks.setdefault(block, []).append((block, expert))
    tensors: dict[str, Tensor] = {}
    for block, keys in blocks.items():
        parts: dict[str, list[Tensor]] = {}
        for key in sorted(keys):
            source.read_into(key, slot)
            views = source.views(key, slot)
            for w in FULL_ROLES:
                q, scale = QUANTIZERS[fmt](views[w])
                parts.setdefault(f"{w}.q", []).append(q)
                parts.setdefault(f"{w}.scale", []).append(scale)
        for role, stacked in parts.items():
            tensors[expert_tensor_prefix(block) + role] = torch.stack(stacked)
    data = save(tensors, metadata={"format": fmt})
    write_atomic(Path(path), lambda f: f.write(data))
    return Path(path)
