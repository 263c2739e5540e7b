"""The launcher path end to end, layout errors before any collective, and a hung rank's timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from moekit import runconfig
from moekit.parallel.mesh import LayoutError
from moekit.parallel.runtime import RankFailure, collective_errors, init_distributed
from moekit.train.loop import train

from .spawn import run_ranks

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _moekit(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moekit", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def test_nproc_launches_an_expert_parallel_run(corpus_file, tmp_path) -> None:
    run_dir = tmp_path / "run"
    flags = ["--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run_dir), "--quiet"]
    done = _moekit("train", "--nproc", "2", *flags, "--parallel.ep", "2", "--train.steps", "4", "--train.eval_every", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(len(r["expert_load"]) == 2 for r in records)  # both MoE blocks, loads summed over ranks
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000004"
    assert (run_dir / "sample.txt").read_text()
    assert "run directory" in done.stdout and done.stdout.count("run directory") == 1  # rank 0 reports once
    rank_logs = sorted((run_dir / "logs").rglob("stderr.log"))
    assert len(rank_logs) == 2 and "moekit rank 1/2" in rank_logs[1].read_text()


def test_bad_layout_fails_before_launching(tmp_path) -> None:
    done = _moekit("train", "--nproc", "2", "--preset", "tiny", "--parallel.ep", "3", "--run-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "moekit train: error: parallel: ep*tp*pp = 3*1*1 = 3 does not divide the world size 2"
    ]


def test_every_rank_rejects_a_bad_layout_before_any_collective(corpus_file, tmp_path, monkeypatch) -> None:
    # Rank 1 of a world whose rank 0 never starts: joining the process group would block, so the
    # error must come first.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")
    cfg = runconfig.resolve("tiny", {"data.path": str(corpus_file), "parallel.ep": "2", "moe.num_experts": "3"})
    started = time.monotonic()
    with pytest.raises(LayoutError, match=r"parallel.ep=2 must divide the experts of every MoE block \(got 3\)"):
        train(cfg, tmp_path / "run", progress=False)
    assert time.monotonic() - started < 10


def _hung_peer(rank: int, world: int) -> None:
    cfg = runconfig.resolve("tiny", {"parallel.timeout_s": "3"})
    init_distributed(cfg, torch.device("cpu"))
    if rank == 1:
        time.sleep(9)  # alive but never joins the collective
        return
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0: a collective failed.*parallel.timeout_s=3s"):
        with collective_errors(cfg.parallel.timeout_s):
            dist.all_reduce(torch.ones(1))
    assert time.monotonic() - started < 8


def test_a_hung_rank_ends_the_others_with_an_error(tmp_path) -> None:
    run_ranks(_hung_peer, 2, tmp_path=tmp_path)
