"""``train.compile`` under expert parallelism (2 ranks, ep=2, FSDP over both) through ``moekit train
--nproc 2``: eager's losses, no recompilation between steps.

Reference: the same run config without ``train.compile``, trained eagerly by ``train()`` on 2 spawned
ranks (the fork server the dist tests share, instead of a second launch: the launcher adds nothing to
eager's losses); both runs' config.json must differ in ``train.compile`` alone. Tolerance 1e-5 on every
step's loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moekit import runconfig
from moekit.train.loop import train

from .spawn import MOEKIT, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FLAGS = {
    "parallel.ep": "2",
    "train.steps": str(STEPS),
    "train.eval_every": str(STEPS),
    "train.ckpt_every": "0",
    "train.sample_tokens": "0",
}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _launch_compiled(corpus: Path, run_dir: Path) -> list[dict]:
    args = ["train", "--nproc", "2", "--preset", "tiny", "--data", str(corpus), "--run-dir", str(run_dir), "--quiet"]
    args += ["--device", "cpu"]  # as train() trains the reference (the device is not in config.json)
    flags = [arg for key, value in FLAGS.items() for arg in (f"--{key}", value)] + ["--train.compile", "true"]
    done = subprocess.run(
        [sys.executable, "-m", "moekit", *args, *flags], capture_output=True, text=True, env=ENV, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _records(run_dir)


def _train_eager(rank: int, world: int, corpus: Path, run_dir: Path) -> None:
    train(runconfig.resolve("tiny", {**FLAGS, "data.path": str(corpus)}), run_dir, progress=False)


def test_compiled_expert_parallel_run_matches_eager(corpus_file: Path, tmp_path: Path) -> None:
    run_ranks(_train_eager, 2, corpus_file, tmp_path / "eager", tmp_path=tmp_path, preload=MOEKIT)
    eager = _records(tmp_path / "eager")
    compiled = _launch_compiled(corpus_file, tmp_path / "compiled")
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("eager", "compiled")]
    assert configs[0]["train"].pop("compile") is False and configs[1]["train"].pop("compile") is True
    assert configs[0] == configs[1]  # the same run but for train.compile
    assert [r["step"] for r in compiled] == list(range(1, STEPS + 1))
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    assert abs(eager[-1]["val_loss"] - compiled[-1]["val_loss"]) <= 1e-5
    first = compiled[0]
    assert first["compile_s"] > 0 and first["compiled_graphs"] >= 2
    assert {r["recompiles"] for r in compiled[:-1]} == {first["recompiles"]}
