"""Block-quantised FP8 checkpoints (DeepSeek-V3, Kimi-K2, the Qwen3 "-FP8" releases) read as full precision.

Those checkpoints store each projection as ``float8_e4m3fn`` plus a ``weight_scale_inv`` grid holding
one fp32 scale per ``weight_block_size`` block (128 x 128). moekit computes in bf16/fp32, so each
weight is dequantised as it is read, the way DeepSeek's own ``weight_dequant`` does (fp32 product,
then the target dtype); the scale tensors themselves are not model tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from moekit.convert.errors import ConversionError
from moekit.convert.safetensors_dir import SafetensorsDir
from moekit.run.layout import CheckpointError
from moekit.run.safetensors_io import read_tensor

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size_of(hf: dict[str, Any]) -> tuple[int, int] | None:
    """The FP8 block shape a ``config.json`` declares, None when it declares no quantisation; any other
    quantisation is an error naming it."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2):
        raise ConversionError(
            f"config.json: quantization_config {quant!r} is not supported "
            "(moekit reads block-wise fp8 with weight_block_size, or unquantised checkpoints)"
        )
    return int(block[0]), int(block[1])


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """``weight`` (rows, cols) times its block's scale, in fp32."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ConversionError(f"scale grid {tuple(scale_inv.shape)} does not fit {(rows, cols)} in {block} blocks")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


class DequantizedDir(SafetensorsDir):
    """A checkpoint directory whose FP8 weights read as fp32, their scales hidden from the tensor list."""

    def __init__(self, path: Path, block: tuple[int, int]) -> None:
        super().__init__(path)
        self.block = block
        self.scale_of = {k.removesuffix(SCALE_SUFFIX): k for k in self.files if k.endswith(SCALE_SUFFIX)}
        self.scale_files = {k: self.files.pop(k) for k in self.scale_of.values()}
        for key, entry in self.entries.items():
            if entry.dtype in FP8_DTYPES and key not in self.scale_of:
                raise ConversionError(f"{self.files[key]}: FP8 tensor {key} has no {key}{SCALE_SUFFIX}")

    def meta(self, key: str) -> Tensor:
        tensor = super().meta(key)
        return tensor.to(torch.float32) if key in self.scale_of else tensor

    def read(self, key: str) -> Tensor:
        if key not in self.scale_of:
            return super().read(key)
        scale_key = self.scale_of[key]
        try:
            scale_inv = read_tensor(self.scale_files[scale_key], self.entries[scale_key])
        except CheckpointError as err:
            raise ConversionError(str(err)) from None
        try:
            return dequantize(super().read(key), scale_inv, self.block)
        except ConversionError as err:
            raise ConversionError(f"{self.files[key]}: {key}: {err}") from None

    def dtype(self) -> torch.dtype:
        """bf16 for a quantised checkpoint: the precision it was trained in, and moekit's smallest."""
        return torch.bfloat16
