"""Quantized experts: int8 / int4 round-trip error within stated bounds; the int8 fast matmul equals
dequantise + mm; an offloaded model with quantized experts stays close to full precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moekit.infer.offload import OffloadOptions
from moekit.infer.quant import (
    dequantize_int4,
    dequantize_int8,
    matmul,
    quantize_int4,
    quantize_int8,
)
from moekit.run.load import load_run


def test_int8_round_trip_error_is_half_a_step_per_channel() -> None:
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 48)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (48, 64) and scale.shape == (48,)
    err = (dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale / 2 + 1e-6).all())
    assert float(err.norm() / w.norm()) < 0.01  # stated bound: < 1% relative (Frobenius)


def test_int4_round_trip_error_is_half_a_step_per_group() -> None:
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_int4(w, group=32)
    assert packed.dtype == torch.uint8 and packed.shape == (32, 48) and scale.shape == (2, 48)
    err = (dequantize_int4(packed, scale) - w).abs()
    assert bool((err <= scale.repeat_interleave(32, dim=0) / 2 + 1e-6).all())
    assert float(err.norm() / w.norm()) < 0.12  # stated bound: < 12% relative for Gaussian weights
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(torch.randn(40, 8), group=32)


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 33])
def test_int8_matmul_equals_dequantised_reference(rows: int) -> None:
    """Up to 32 rows torch's int8 kernel (rows and scales rounded to bf16 for it), above them dequantise +
    matmul in the rows' dtype: each within bf16 rounding of its float64 product."""
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 96, generator=gen), torch.randn(rows, 64, generator=gen)
    q, scale = quantize_int8(w)
    views = {"w_in.q": q, "w_in.scale": scale}
    kernel = rows <= 32
    x_ref = x.bfloat16().double() if kernel else x.double()
    scale_ref = scale.bfloat16().double() if kernel else scale.double()
    ref = x_ref @ (q.double() * scale_ref.unsqueeze(1)).t()
    magnitude = x_ref.abs() @ (q.double() * scale_ref.unsqueeze(1)).abs().t()
    err = (matmul("int8", views, "w_in", x).double() - ref).abs()
    assert bool((err <= 2.0**-7 * magnitude + 1e-6).all())


@pytest.mark.parametrize(("fmt", "tolerance"), [("int8", 0.02), ("int4", 0.25)])
def test_quantized_offloaded_logits_stay_close(tmp_path: Path, write_run, fmt: str, tolerance: float) -> None:
    run_dir = write_run(tmp_path / "run")
    ids = torch.tensor([[5, 17, 99, 3, 42, 8, 1, 77, 120, 64]])
    with torch.no_grad():
        reference = load_run(run_dir).model(ids).logits
    run = load_run(run_dir, offload=OffloadOptions(memory_budget=1 << 30, expert_format=fmt))
    try:
        with torch.no_grad():
            logits = run.model(ids).logits
        assert (run_dir / "checkpoints" / run.checkpoint.name / f"experts-{fmt}.safetensors").is_file()
        assert run.offloader.store.bytes_per_expert < {"int8": 0.3, "int4": 0.2}[fmt] * (32 * 128 + 64 * 32) * 4
        assert float((logits - reference).norm() / reference.norm()) < tolerance
    finally:
        run.offloader.close()
