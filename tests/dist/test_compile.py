"""``train.compile`` under expert parallelism (2 ranks, ep=2, FSDP over both) through ``moekit train
--nproc 2``: eager's losses, no recompilation between steps.

Reference: the same command without ``--train.compile``. Tolerance 1e-5 on every step's loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(corpus: Path, run_dir: Path, *extra: str) -> list[dict]:
    args = ["train", "--nproc", "2", "--preset", "tiny", "--data", str(corpus), "--run-dir", str(run_dir), "--quiet"]
    flags = ["--parallel.ep", "2", "--train.steps", str(STEPS), "--train.eval_every", str(STEPS)]
    flags += ["--train.ckpt_every", "0", "--train.sample_tokens", "0", *extra]
    done = subprocess.run(
        [sys.executable, "-m", "moekit", *args, *flags], capture_output=True, text=True, env=ENV, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_compiled_expert_parallel_run_matches_eager(corpus_file: Path, tmp_path: Path) -> None:
    eager = _train(corpus_file, tmp_path / "eager")
    compiled = _train(corpus_file, tmp_path / "compiled", "--train.compile", "true")
    assert [r["step"] for r in compiled] == list(range(1, STEPS + 1))
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    assert abs(eager[-1]["val_loss"] - compiled[-1]["val_loss"]) <= 1e-5
    first = compiled[0]
    assert first["compile_s"] > 0 and first["compiled_graphs"] >= 2
    assert {r["recompiles"] for r in compiled[:-1]} == {first["recompiles"]}
