"""Quantized expert weights: fewer bytes in the slow tier, in the cache and on the wire.

Legend: K input dim, N output dim (weights are stored [in, out], as the experts use them), G group.

- ``int8``: weight-only, one fp32 scale per output channel: ``w ~= q * scale[n]``, q in [-127, 127].
  Round-trip error per element <= scale[n] / 2.
- ``int4``: group-wise along the input dim (G rows share a scale per output channel), symmetric
  q in [-8, 7] (scale = absmax / 7), two values packed per byte. Error per element <= scale / 2.

Experts are dequantised to the compute dtype when a layer uses them (the cache keeps the quantized
form, so a budget holds 4x / ~7x as many experts). NOTE: torch's ``_weight_int8pack_mm`` was measured
slower than dequantise + ``torch.mm`` at decode batch sizes on CPU (see benchmarks/offload.py), so it
is not used.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor

from moekit.infer.expert_store import ExpertStore, Key, expert_tensor_prefix
from moekit.train.fileio import write_atomic

QUANT_FORMATS = ("int8", "int4")
INT4_GROUP = 32
FULL_ROLES = ("w_in", "w_out")


def roles(fmt: str) -> tuple[str, ...]:
    """Tensor names of one expert in a store of format ``fmt`` (``fp`` or a QUANT_FORMATS entry)."""
    if fmt == "fp":
        return FULL_ROLES
    return tuple(f"{w}.{part}" for w in FULL_ROLES for part in ("q", "scale"))


def quantize_int8(w_KN: Tensor) -> tuple[Tensor, Tensor]:
    """int8 q [K, N] and fp32 scale [N] (per output channel, absmax / 127)."""
    w = w_KN.float()
    scale = w.abs().amax(dim=0).clamp_min(1e-12) / 127
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q_KN: Tensor, scale_N: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q_KN.to(dtype) * scale_N.to(dtype)).to(dtype)


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


def expert_weights(fmt: str, views: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(w_in [D, W], w_out [F, D]) of one expert from its stored tensors, in ``dtype``."""
    if fmt == "fp":
        return views["w_in"].to(dtype), views["w_out"].to(dtype)
    dequant = DEQUANTIZERS[fmt]
    return tuple(dequant(views[f"{w}.q"], views[f"{w}.scale"], dtype) for w in FULL_ROLES)  # type: ignore[return-value]


def write_quantized_store(source: ExpertStore, path: Path, fmt: str) -> Path:
    """Quantize every expert of a full-precision store into a new safetensors file (atomic write).

    Experts are read one at a time through the store, so the full-precision weights are never all
    in memory; the quantized tensors (a quarter or less of them) are.
    """
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"expert format {fmt!r}: choose from fp, {', '.join(QUANT_FORMATS)}")
    slot = torch.empty(source.slot_bytes, dtype=torch.uint8)
    blocks: dict[int, list[Key]] = {}
    for block, expert in source.pieces:
        blocks.setdefault(block, []).append((block, expert))
    tensors: dict[str, Tensor] = {}
    for block, keys in blocks.items():
        parts: dict[str, list[Tensor]] = {}
        for key in sorted(keys):
            source.read_into(key, slot)
            views = source.views(slot)
            for w in FULL_ROLES:
                q, scale = QUANTIZERS[fmt](views[w])
                parts.setdefault(f"{w}.q", []).append(q)
                parts.setdefault(f"{w}.scale", []).append(scale)
        for role, stacked in parts.items():
            tensors[expert_tensor_prefix(block) + role] = torch.stack(stacked)
    data = save(tensors, metadata={"format": fmt})
    write_atomic(Path(path), lambda f: f.write(data))
    return Path(path)
