"""Training on a CUDA device: fp32 losses equal the CPU run's to rounding, bf16 trains with fp32 master
weights and an MFU read against the GPU's peak, a checkpoint written on the GPU loads on the CPU with
the same outputs, and per-block torch.compile (inductor's GPU kernels) trains to eager's losses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import tiny

from moekit.run.load import load_run
from moekit.train.loop import train
from moekit.train.peak import gpu_peak_tflops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_fp32_losses_equal_the_cpu_run(corpus_file: Path, tmp_path: Path) -> None:
    """Same data, seed and init (drawn on the CPU, then moved): only summation order differs, so the
    losses agree to 1e-4 relative over the steps (a wrong gradient moves them by far more in 8 steps)."""
    cfg = tiny(corpus_file, tmp_path / "cache", **{"train.steps": "8"})
    cpu = train(cfg, tmp_path / "cpu", progress=False)
    gpu = train(cfg, tmp_path / "cuda", device="cuda", progress=False)
    for step, (a, b) in enumerate(zip(gpu.losses, cpu.losses, strict=True), 1):
        assert math.isclose(a, b, rel_tol=1e-4), (step, a, b)


def test_bf16_trains_and_its_checkpoint_loads_on_the_cpu(corpus_file: Path, tmp_path: Path) -> None:
    cfg = tiny(corpus_file, tmp_path / "cache", **{"train.dtype": "bf16", "train.steps": "20"})
    result = train(cfg, tmp_path / "run", device="cuda", progress=False)
    assert all(math.isfinite(x) for x in result.losses)
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3 - 0.5
    mfu = [json.loads(line).get("mfu") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    if gpu_peak_tflops(torch.cuda.get_device_name(), "bf16") is None:
        assert mfu == [None] * 20  # an unknown GPU: no MFU
    else:  # read against the GPU's peak, not the CPU default
        assert all(0 < m < 1 for m in mfu)
    on_gpu, on_cpu = load_run(tmp_path / "run", "cuda").model, load_run(tmp_path / "run").model
    assert all(w.dtype == torch.float32 for w in on_cpu.state_dict().values())  # fp32 master weights
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(on_gpu(ids.cuda()).logits.cpu(), on_cpu(ids).logits, atol=1e-4, rtol=1e-4)


def test_compiled_training_matches_eager_and_does_not_recompile(corpus_file: Path, tmp_path: Path) -> None:
    """Tolerance 1e-5 on every loss over 10 steps, as on the CPU (inductor fuses and reorders float
    reductions); a wrong fused kernel moves the first loss by far more."""
    run = {"model.moe_every": "2", "train.steps": "10", "train.eval_every": "10", "train.sample_tokens": "0"}
    eager = train(tiny(corpus_file, tmp_path / "cache", **run), tmp_path / "eager", device="cuda", progress=False)
    compiled_cfg = tiny(corpus_file, tmp_path / "cache", **run, **{"train.compile": "true"})
    compiled = train(compiled_cfg, tmp_path / "compiled", device="cuda", progress=False)
    assert max(abs(a - b) for a, b in zip(eager.losses, compiled.losses, strict=True)) <= 1e-5
    records = [json.loads(line) for line in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["compile_s"] > 0 and records[0]["compiled_graphs"] >= 2
    assert {(r["compiled_graphs"], r["recompiles"]) for r in records[:-1]} == {
        (records[0]["compiled_graphs"], records[0]["recompiles"])
    }
