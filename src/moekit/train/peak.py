"""The device peak that MFU is read against when the config names none."""

from __future__ import annotations

import torch

# Dense bf16 matrix peaks (TFLOP/s, no sparsity) from the vendors' datasheets, matched in this order
# against the CUDA device's name: the first name it contains wins.
GPU_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
)
CPU_PEAK_TFLOPS = 0.5  # about what a 2-core laptop CPU reaches in fp32 matmuls


def peak_tflops(configured: float | None, device: torch.device) -> float | None:
    """``configured`` where given; else the table's figure for this GPU, the CPU figure on a CPU, or
    None (no MFU) for a GPU the table does not know: a made-up peak would print a made-up MFU."""
    if configured is not None:
        return configured
    if device.type == "cpu":
        return CPU_PEAK_TFLOPS
    return gpu_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def gpu_peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in GPU_PEAK_TFLOPS if key in name), None)
