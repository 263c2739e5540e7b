"""Training in process on CPU: loss falls, resume is bitwise, bf16 trains, an existing run needs --resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import tiny

from moekit.errors import OptionError
from moekit.run.layout import latest_checkpoint
from moekit.run.load import load_run
from moekit.run.manifest import read_manifest
from moekit.train.loop import train


@pytest.mark.slow
def test_thirty_steps_lower_the_loss(corpus_file: Path, tmp_path: Path) -> None:
    result = train(tiny(corpus_file, tmp_path / "cache"), tmp_path / "run", progress=False)
    assert result.steps == 30
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert result.val_loss is not None and result.val_loss < first
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert {"loss", "lr", "tokens_per_s", "mfu", "aux_loss", "z_loss", "load_cv", "dropped_frac"} <= set(records[-1])
    assert [(r["skipped"], r["skipped_steps"]) for r in records] == [(False, 0)] * 30  # no update was skipped
    assert read_manifest(latest_checkpoint(run))["skipped_steps"] == 0 and result.skipped_steps == 0
    assert len(records[-1]["load_max_over_mean"]) == 2  # one per MoE block
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == 256
    assert any((run / "tensorboard").iterdir())


@pytest.mark.slow
def test_resume_equals_uninterrupted_bitwise(corpus_file: Path, tmp_path: Path) -> None:
    cfg = tiny(
        corpus_file, tmp_path / "cache", **{"train.steps": "20", "moe.router": "noisy_topk", "model.dropout": "0.1"}
    )
    full = train(cfg, tmp_path / "full", progress=False)
    # The same run stopped after step 10: keep only its step-10 checkpoint, then resume.
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "full", half)
    shutil.rmtree(half / "checkpoints" / "step_000020")
    (half / "checkpoints" / "latest").write_text("step_000010")
    resumed = train(cfg, half, resume=True, progress=False)
    assert resumed.losses == full.losses[10:]  # exact float equality
    a = load_run(tmp_path / "full").model.state_dict()
    b = load_run(half).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_bf16_autocast_trains(corpus_file: Path, tmp_path: Path) -> None:
    cfg = tiny(corpus_file, tmp_path / "cache", **{"train.dtype": "bf16", "train.steps": "20"})
    result = train(cfg, tmp_path / "run", progress=False)
    assert all(math.isfinite(x) for x in result.losses)
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3 - 0.5
    weights = load_run(tmp_path / "run").model.state_dict()
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 master weights


def test_existing_run_needs_resume(corpus_file: Path, tmp_path: Path) -> None:
    cfg = tiny(corpus_file, tmp_path / "cache", **{"train.steps": "2"})
    train(cfg, tmp_path / "run", progress=False)
    with pytest.raises(OptionError, match=r"^run_dir=.*: already holds a trained run; pass resume=True"):
        train(cfg, tmp_path / "run", progress=False)
    with pytest.raises(OptionError, match=r"^resume=True: .* no checkpoint"):
        train(cfg, tmp_path / "other", resume=True, progress=False)
