"""A worker of a 4-rank run killed with SIGKILL mid-training: torch's elastic agent restarts the ranks,
which resume from the latest complete checkpoint by themselves and finish; the final model equals a
run restarted at that step by hand (here in one process, reading the same checkpoint)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import moekit
from moekit import runconfig
from moekit.run.layout import latest_checkpoint
from moekit.run.load import load_run
from moekit.train.loop import train

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, EVERY = 12, 3
SRC = str(Path(moekit.__file__).resolve().parents[1])
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
FLAGS = {
    "model.context_length": "32",
    "train.batch_size": "4",
    "train.steps": str(STEPS),
    "train.ckpt_every": str(EVERY),
    "train.keep_checkpoints": "20",
    "train.eval_every": "1000",
    "train.eval_iters": "1",
    "train.sample_tokens": "0",
}


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_a_killed_rank_restarts_from_the_last_complete_checkpoint(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = {**FLAGS, "data.cache_dir": str(tmp_path / "cache")}
    argv = [sys.executable, "-m", "moekit", "train", "--nproc", "4", "--max-restarts", "1", "--quiet"]
    argv += ["--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run), "--parallel.ep", "2"]
    argv += [arg for key, value in overrides.items() for arg in (f"--{key}", value)]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 300  # a loaded machine starts 4 ranks slowly
        while latest_checkpoint(run) is None and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = latest_checkpoint(run)
        workers = _children(launcher.pid)
        assert seen is not None and len(workers) == 4, (seen, workers)
        os.kill(workers[-1], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=600)
    finally:
        for pid in [*_children(launcher.pid), launcher.pid] if launcher.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == 0, stderr[-3000:]
    resumed = re.findall(r"resuming at step (\d+)", stderr)
    assert len(resumed) == 1, stderr[-3000:]  # rank 0 of the restarted ranks resumed, once
    step = int(resumed[0])
    assert step >= int(seen.name.removeprefix("step_")) and step % EVERY == 0 and step < STEPS
    assert latest_checkpoint(run).name == f"step_{STEPS:06d}"

    # The reference: the same checkpoint resumed by hand (one process keeps the global batch of 4).
    ref = tmp_path / "ref"
    shutil.copytree(run, ref)
    for later in (ref / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (ref / "checkpoints" / "latest").write_text(f"step_{step:06d}")
    cfg = runconfig.from_json(ref / "config.json")
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=1, dp=0))
    train(cfg, ref, resume=True, progress=False)
    got, want = load_run(run).model.state_dict(), load_run(ref).model.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
