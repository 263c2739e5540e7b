"""The peak MFU is read against: the config's, a known GPU's by name, the CPU figure, or none."""

from __future__ import annotations

import pytest
import torch

from moekit.train.peak import CPU_PEAK_TFLOPS, gpu_peak_tflops, peak_tflops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),  # not in the table: no MFU rather than a guessed one
    ],
)
def test_gpu_peaks_by_device_name(name: str, peak: float | None) -> None:
    assert gpu_peak_tflops(name) == peak


def test_the_config_wins_and_a_cpu_has_its_own() -> None:
    assert peak_tflops(123.0, torch.device("cpu")) == 123.0
    assert peak_tflops(None, torch.device("cpu")) == CPU_PEAK_TFLOPS
    assert peak_tflops(None, torch.device("meta")) is None
