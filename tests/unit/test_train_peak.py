"""The peak MFU is read against: the config's, a known GPU's by name and training dtype, the CPU
figure, or none."""

from __future__ import annotations

import pytest
import torch

from moekit.train.peak import CPU_PEAK_TFLOPS, gpu_peak_tflops, peak_tflops


@pytest.mark.parametrize(
    ("name", "bf16", "fp32"),
    [
        ("NVIDIA H200", 989.0, 67.0),
        ("NVIDIA H200 NVL", 835.0, 60.0),
        ("NVIDIA H100 80GB HBM3", 989.0, 67.0),
        ("NVIDIA H100 PCIe", 756.0, 51.0),
        ("NVIDIA H100 NVL", 835.0, 60.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 19.5),
        ("Tesla T4", None, None),  # not in the table: no MFU rather than a guessed one
    ],
)
def test_gpu_peaks_by_device_name_and_dtype(name: str, bf16: float | None, fp32: float | None) -> None:
    assert gpu_peak_tflops(name, "bf16") == bf16
    assert gpu_peak_tflops(name, "fp32") == fp32


def test_the_config_wins_and_a_cpu_has_its_own() -> None:
    assert peak_tflops(123.0, torch.device("cpu"), "fp32") == 123.0
    assert peak_tflops(None, torch.device("cpu"), "bf16") == CPU_PEAK_TFLOPS
    assert peak_tflops(None, torch.device("meta"), "fp32") is None
