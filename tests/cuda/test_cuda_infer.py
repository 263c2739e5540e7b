"""Inference on a CUDA device: greedy tokens equal the CPU's, resident or with experts offloaded to
pinned host memory, through the Python API and through ``moekit generate``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import budget_for, moekit_cli

from moekit.infer.generate import generate, left_pad
from moekit.run.load import load_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 17, 99, 3, 42, 8, 1], [200, 13], [7, 7, 7, 7]]


def greedy(model, device: str) -> torch.Tensor:
    ids, pad = left_pad(PROMPTS)
    return generate(model, ids.to(device), 16, temperature=0, left_pad_B=pad.to(device)).cpu()


def test_greedy_tokens_and_logits_equal_the_cpu(run_dir: Path) -> None:
    cpu, gpu = load_run(run_dir).model, load_run(run_dir, "cuda").model
    assert torch.equal(greedy(gpu, "cuda"), greedy(cpu, "cpu"))
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gpu(ids.cuda()).logits.cpu(), cpu(ids).logits, atol=1e-4, rtol=1e-4)


def test_cli_generate_offloaded_on_cuda_equals_resident(run_dir: Path) -> None:
    argv = ["generate", str(run_dir), "--prompt", "the king", "--max-new-tokens", "12", "--temperature", "0"]
    resident = moekit_cli(*argv, "--device", "cuda")
    offloaded = moekit_cli(*argv, "--device", "cuda", "--memory-budget", str(budget_for(run_dir, 2)))
    on_cpu = moekit_cli(*argv, "--device", "cpu")
    assert resident.returncode == offloaded.returncode == on_cpu.returncode == 0, offloaded.stderr
    assert resident.stdout == offloaded.stdout == on_cpu.stdout and resident.stdout.startswith("the king")
    assert "hit rate" in offloaded.stderr and "prefetch recall" not in offloaded.stderr  # auto: none on a GPU
