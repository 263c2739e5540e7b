"""Upcycling a trained dense run and continuing it with ``moekit train --init``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moekit import runconfig
from moekit.cli import main
from moekit.run.load import load_run
from moekit.train.loop import train

pytestmark = pytest.mark.slow


def test_upcycle_a_run_then_train_from_it(corpus_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dense_cfg = runconfig.resolve(
        "tiny",
        {"data.path": str(corpus_file), "data.cache_dir": str(tmp_path / "cache"), "model.moe_every": "0"},
    )
    dense = train(dense_cfg, tmp_path / "dense", progress=False)  # the tiny preset's 30 steps
    up = tmp_path / "up"
    capsys.readouterr()
    assert main(["upcycle", str(tmp_path / "dense"), "--experts", "4", "--top-k", "5", "--out", str(up)]) == 2
    assert capsys.readouterr().err == "moekit upcycle: error: --top-k=5: cannot exceed --experts=4\n"
    assert main(["upcycle", str(tmp_path / "dense"), "--experts", "4", "--top-k", "2", "--out", str(up)]) == 0
    dense_run, up_run = load_run(tmp_path / "dense"), load_run(up)
    assert up_run.config.is_moe and up_run.config.data.path == str(corpus_file)
    ids = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (up_run.model(ids).logits - dense_run.model(ids).logits).abs().max().item() < 1e-5

    # --resume is for runs with optimizer state; a weights-only run says how to start from it.
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(up), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "start from it with --init" in err and len(err.strip().splitlines()) == 1

    cont = tmp_path / "cont"
    flags = ["--train.steps", "3", "--train.sample_tokens", "0", "--train.warmup_steps", "0", "--quiet"]
    assert main(["train", "--init", str(up), "--run-dir", str(cont), *flags]) == 0
    first = json.loads((cont / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    # It starts where the dense run ended, not at the ~5.5 nats of a fresh byte-level model.
    assert abs(first - dense.losses[-1]) < 0.3, (first, dense.losses[-1])
    assert json.loads((cont / "config.json").read_text())["moe"]["num_experts"] == 4
