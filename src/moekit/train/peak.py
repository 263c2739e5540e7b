"""The device peak that MFU is read against when the config names none."""

from __future__ import annotations

import torch

# Dense matrix peaks (TFLOP/s, no sparsity) from the vendors' datasheets: bf16 on the tensor cores, and
# fp32 (which moekit runs without TF32). Matched in this order against the CUDA device's name: the
# first name it contains wins.
GPU_PEAK_TFLOPS = (  # name, bf16, fp32
    ("H200 NVL", 835.0, 60.0),
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),
    ("A100", 312.0, 19.5),
)
CPU_PEAK_TFLOPS = 0.5  # about what a 2-core laptop CPU reaches in fp32 matmuls


def peak_tflops(configured: float | None, device: torch.device, dtype: str) -> float | None:
    """``configured`` where given; else the table's figure for this GPU and training dtype (fp32 or
    bf16), the CPU figure on a CPU, or None (no MFU) for a GPU the table does not know: a made-up peak
    would print a made-up MFU."""
    if configured is not None:
        return configured
    if device.type == "cpu":
        return CPU_PEAK_TFLOPS
    return gpu_peak_tflops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None


def gpu_peak_tflops(name: str, dtype: str) -> float | None:
    for key, bf16, fp32 in GPU_PEAK_TFLOPS:
        if key in name:
            return bf16 if dtype == "bf16" else fp32
    return None
