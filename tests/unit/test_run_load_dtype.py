"""Runs load in their checkpoint's dtype, or the one asked for: bf16 weights stay bf16 (no fp32 copy),
and a bf16 model's logits stay close to the fp32 model's.

Tolerance: bf16 keeps 8 significant bits, so each rounding moves a value by up to 2^-9 of itself;
through a few layers the logits move by a few % of their largest magnitude. We require 5%.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moekit import runconfig
from moekit.infer.generate import generate
from moekit.infer.offload import OffloadOptions
from moekit.model import Transformer
from moekit.run.checkpoint import save_weights_run
from moekit.run.layout import latest_checkpoint
from moekit.run.load import checkpoint_dtype, load_run
from moekit.tokenizer import ByteTokenizer

BF16_REL_TOL = 0.05


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _ids() -> torch.Tensor:
    return torch.randint(256, (2, 24), generator=torch.Generator().manual_seed(0))


def test_fp32_run_loads_in_bf16_on_request(write_run, tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    full = load_run(run).model
    assert checkpoint_dtype(latest_checkpoint(run)) == torch.float32
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    half = load_run(run, dtype=torch.bfloat16).model
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.rope_freqs.dtype == torch.complex64  # the RoPE table is not cast (it would lose its phase)
    reference = _logits(full, _ids())
    assert (reference - _logits(half, _ids())).abs().max().item() < BF16_REL_TOL * reference.abs().max().item()


def _bf16_run(run: Path) -> Path:
    cfg = runconfig.resolve("tiny", {"model.n_layers": "3", "moe.num_experts": "6", "model.context_length": "48"})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # decisive greedy choices
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    save_weights_run(run, cfg.to_json(), model, ByteTokenizer(), "test")
    return run


def test_bf16_checkpoint_loads_in_bf16_resident_and_offloaded(tmp_path: Path) -> None:
    run = _bf16_run(tmp_path / "run")
    assert checkpoint_dtype(latest_checkpoint(run)) == torch.bfloat16
    resident = load_run(run).model
    assert {p.dtype for p in resident.parameters()} == {torch.bfloat16}
    offloaded = load_run(run, offload=OffloadOptions(memory_budget=1 << 30))
    try:
        assert {p.dtype for p in offloaded.model.parameters()} == {torch.bfloat16}
        prompt = _ids()[:1, :6]
        assert torch.equal(
            generate(resident, prompt, 12, temperature=0), generate(offloaded.model, prompt, 12, temperature=0)
        )
    finally:
        offloaded.offloader.close()
    widened = load_run(run, dtype=torch.float32).model
    assert {p.dtype for p in widened.parameters()} == {torch.float32}
    assert torch.equal(widened.embed.weight, resident.embed.weight.float())
