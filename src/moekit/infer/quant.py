"""Quantized expert weights: fewer bytes in the slow tier, in the cache and read per token.

Legend: K input dim, N output dim (weights are stored [in, out], as the experts use them), G group.

- ``int8``: weight-only, one fp32 scale per output channel: ``w ~= q * scale[n]``, q in [-127, 127],
  stored [N, K] (the layout ``torch._weight_int8pack_mm`` takes). Round-trip error <= scale[n] / 2.
- ``int4``: group-wise along the input dim (G rows share a scale per output channel), symmetric
  q in [-8, 7] (scale = absmax / 7), two values packed per byte. Error per element <= scale / 2.

From fp32 experts, int8 stores ~4x fewer bytes and int4 6.4x (half a byte per weight plus an fp32 scale
per 32). The cache keeps the quantized form, so a budget holds about as many times more experts.

Two places hold them: an offloaded run's quantized store (a file written once, read expert by expert into
the cache), and experts quantized in memory at load (``infer.resident_experts``, no file).

The products use weight-only CPU kernels, which read the int8 / int4 weights and convert them inside
the kernel: ``torch._weight_int8pack_mm`` for up to ``INT8PACK_MAX_ROWS`` rows of an expert
(dequantise + matmul above; one row by ``moekit.kernels.rows_int8`` on AVX2, ``INT8_ROW_KERNEL_ISAS``),
and ``torch._weight_int4pack_mm_for_cpu`` over torch's own int4 packing (experts held in memory; an
offloaded int4 store keeps the packing above and is dequantised per product). torch's kernels take
bf16 activations: in fp32 they ran 10-30x slower, so their rows are rounded to bf16 whatever the
model's dtype (moekit's int8 row kernel is given the same bf16 rows and scales).

NOTE: ``benchmarks/measured/cpu-matmul.json`` (``python benchmarks/cpu_matmul.py``: an AMD EPYC with
AVX512-BF16, one thread, 1024 x 4096 weights streamed from memory, ms per weight): one row, bf16
prepacked 0.25, int8 0.26, int4 0.15; 32 rows, int8's kernel 1.68 against 1.73 dequantised; 512 rows,
int8 (dequantised) 9.9, int4's kernel 24.4, bf16 prepacked 8.7: int4 prefills slower than bf16.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor

from moekit.experts.matmul import inference_layout, mm, plain_linear, unpacked_linear
from moekit.fileio import write_atomic
from moekit.infer.expert_store import ExpertStore, Key, expert_tensor_prefix
from moekit.kernels import FEW_ROWS, rows_int8, rows_isa
from moekit.storage.aligned import aligned_empty

QUANT_FORMATS = ("int8", "int4")
INT4_GROUP = 32
INT8PACK_MAX_ROWS = 32
KERNEL_DTYPE = torch.bfloat16  # the activations torch's weight-only CPU kernels are fast in
# NOTE: where moekit's int8 row kernel replaces torch's at one row: on AVX2 (a Zen 3, 2 threads, 1024 x 4096)
# 0.51 ms against torch's 0.70 (``python benchmarks/cpu_matmul.py --threads 2 --rows 1 2 8 16 32``, the
# "int8" columns, benchmarks/measured/cpu-matmul-2-threads-rows-avx2.json); torch's AVX-512 int8 kernel
# was not measured against it, so that build keeps torch's.
INT8_ROW_KERNEL_ISAS = ("avx2",)
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


def int4_codes(w_KN: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """Codes q [K, N] in 0..15 (int16; the weight is ``(q - 8) * scale``) and fp32 scale [K/G, N]."""
    K, N = w_KN.shape
    if K % group or group % 2:
        raise ValueError(f"int4 needs the input dim ({K}) to be a multiple of the group size ({group}, even)")
    w = w_KN.float().reshape(K // group, group, N)
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 7
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-8, 7).to(torch.int16).view(K, N) + 8
    return q, scale


def quantize_int4(w_KN: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """Packed uint8 [K/2, N] (row 2i in the low nibble, 2i+1 in the high) and fp32 scale [K/G, N]."""
    q, scale = int4_codes(w_KN, group)
    return (q[0::2] | (q[1::2] << 4)).to(torch.uint8), scale


def pack_int4_for_cpu(w_KN: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """torch's CPU int4 packing of ``int4_codes``: uint8 [N, K/2] in its own tile order, and bf16 scales
    and zeros [K/G, N, 2] (zero 0: the kernel subtracts 8 from each code), for ``int4_mm``."""
    q, scale = int4_codes(w_KN, group)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.t().contiguous().to(torch.int32), 2)
    scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).to(KERNEL_DTYPE)
    return packed, scales_and_zeros


def int4_mm(x_MK: Tensor, packed: Tensor, scales_and_zeros: Tensor) -> Tensor:
    """``x @ w`` for a weight packed by ``pack_int4_for_cpu`` (rows rounded to bf16 for the kernel)."""
    group = packed.shape[1] * 2 // scales_and_zeros.shape[0]
    y = torch._weight_int4pack_mm_for_cpu(x_MK.to(KERNEL_DTYPE), packed, group, scales_and_zeros)
    return y.to(x_MK.dtype)


def int8_mm(x_MK: Tensor, q_NK: Tensor, scale_N: Tensor) -> Tensor:
    """``x @ w`` for ``w = q.t() * scale``: on a CPU, ``kernels.FEW_ROWS`` row (a batch-1 decode's) by
    moekit's int8 row kernel where its build is in ``INT8_ROW_KERNEL_ISAS``, few rows by torch's int8
    kernel (both given the rows and scales rounded to bf16), else the weight dequantised into the rows'
    dtype and multiplied (``experts.matmul.mm``)."""
    rows, cpu = x_MK.shape[0], x_MK.device.type == "cpu"
    if rows <= FEW_ROWS and cpu and q_NK.is_contiguous() and rows_isa() in INT8_ROW_KERNEL_ISAS:
        # the inputs torch's kernel takes (bf16 rows and scales): only the order of the sums differs
        return rows_int8(x_MK.to(KERNEL_DTYPE), q_NK, scale_N.to(KERNEL_DTYPE)).to(x_MK.dtype)
    if rows <= INT8PACK_MAX_ROWS and cpu:
        return torch._weight_int8pack_mm(x_MK.to(KERNEL_DTYPE), q_NK, scale_N.to(KERNEL_DTYPE)).to(x_MK.dtype)
    return mm(x_MK, dequantize_int8(q_NK, scale_N, x_MK.dtype))


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


def matmul(fmt: str, views: dict[str, Tensor], role: str, x_MK: Tensor, kernel: str = "mm") -> Tensor:
    """``x @ w`` for weight ``role`` (w_in or w_out) of one expert stored in format ``fmt``; a full-precision
    one by the resident model's kernel for its experts: ``mm``, the prepacked experts' (``packed``) or the
    row layout's (``rows``)."""
    if fmt == "fp":
        # NOTE: the resident model's layout and kernel (``experts.matmul``), so the same numbers: a weight
        # stored otherwise (a 16-bit run's [in, out], or another dtype) is laid out anew for the product.
        w_KN = inference_layout(views[role], x_MK.dtype)
        if kernel == "packed":
            return unpacked_linear(x_MK, w_KN.t())
        if kernel == "rows":
            return plain_linear(x_MK, w_KN.t().contiguous())
        if kernel != "mm":
            raise ValueError(f"kernel {kernel!r}: choose from mm, packed, rows")
        return mm(x_MK, w_KN)
    q, scale = views[f"{role}.q"], views[f"{role}.scale"]
    if fmt == "int8":
        return int8_mm(x_MK, q, scale)
    return mm(x_MK, dequantize_int4(q, scale, x_MK.dtype))


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
