"""The launcher path end to end, layout errors before any collective, and a hung rank's timeout."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import write_corpus

from moekit import runconfig
from moekit.parallel.mesh import LayoutError
from moekit.parallel.failures import RankFailure, collective_errors, exit_after_rank_failure
from moekit.parallel.runtime import init_distributed
from moekit.run.load import load_run
from moekit.train.loop import train

from .spawn import MOEKIT, run_ranks

pytestmark = pytest.mark.dist

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _moekit(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moekit", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Two ``moekit train --nproc 2`` runs, each in its own run directory with its own token cache: "ep"
    (expert parallel, 4 steps) and "dp" (data parallel, 2 steps), launched side by side (importing torch
    in a launcher and its two ranks is most of a launch: two launches share the cores better)."""
    tmp = tmp_path_factory.mktemp("launched")
    corpus = write_corpus(tmp / "corpus.txt")
    more = {"ep": ["--parallel.ep", "2", "--train.steps", "4"], "dp": ["--train.steps", "2"]}
    procs = {}
    for name, flags in more.items():
        flags = [*flags, "--train.eval_every", "2", "--data.cache_dir", str(tmp / f"cache-{name}")]
        argv = ["train", "--nproc", "2", "--preset", "tiny", "--data", str(corpus), "--run-dir", str(tmp / name)]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "moekit", *argv, "--quiet", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
    try:
        done = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), tmp / name)
        return done
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_nproc_launches_an_expert_parallel_run(launched) -> None:
    done, run_dir = launched["ep"]
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(len(r["expert_load"]) == 2 for r in records)  # both MoE blocks, loads summed over ranks
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000004"
    assert (run_dir / "sample.txt").read_text()
    assert "run directory" in done.stdout and done.stdout.count("run directory") == 1  # rank 0 reports once
    rank_logs = sorted((run_dir / "logs").rglob("stderr.log"))
    assert len(rank_logs) == 2 and "moekit rank 1/2" in rank_logs[1].read_text()


@pytest.mark.slow
def test_expert_parallel_virtual_pipelines_checkpoint_and_resume(corpus_file, tmp_path) -> None:
    """The README's ep x interleaved pipeline command saves its checkpoints, and a resume of it at the
    other virtual-stage schedule (``looped_bfs``) loads one and trains on as the same run uninterrupted
    would (loss and gradient norm within 1e-6 relative, weights within 1e-6): both schedules hold two
    stage modules per rank, which expert-parallel checkpointing reads expert by expert.

    Two launches: the uninterrupted run (3 steps, a checkpoint after each) is also the one whose step-2
    checkpoint the resume loads, from a copy of the run directory cut back to that step."""
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
    flags = ["--preset", "tiny", "--data", str(corpus_file), "--quiet", "--train.sample_tokens", "0"]
    flags += ["--parallel.ep", "2", "--parallel.pp", "2", "--model.tie_embeddings", "false", "--model.n_layers", "4"]
    flags += ["--train.eval_every", "100", "--train.ckpt_every", "1", "--train.steps", "3"]
    done = _moekit(
        "train", "--nproc", "4", *flags, "--run-dir", str(straight_dir), "--parallel.pp_schedule", "interleaved_1f1b"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoints = straight_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000002", "step_000003"]  # keep_checkpoints=2
    straight = [json.loads(line) for line in (straight_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in straight] == [1, 2, 3]

    # The run as it stood after step 2: its checkpoint latest, the later one and step 3's record gone.
    shutil.copytree(straight_dir, run_dir, ignore=shutil.ignore_patterns("step_000003"))
    (run_dir / "checkpoints" / "latest").write_text("step_000002")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in straight[:2]))
    resumed = _moekit(
        "train", "--nproc", "4", *flags, "--run-dir", str(run_dir), "--resume", "--parallel.pp_schedule", "looped_bfs"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    step_2 = run_dir / "checkpoints" / "step_000002"
    assert f"resuming at step 2 from {step_2}" in resumed.stderr, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    for key in ("loss", "grad_norm"):
        assert abs(records[2][key] - straight[2][key]) <= 1e-6 * abs(straight[2][key]), (key, records[2], straight[2])
    mine, want = load_run(run_dir).model.state_dict(), load_run(straight_dir).model.state_dict()
    assert max((mine[k] - w).abs().max().item() for k, w in want.items()) <= 1e-6


@pytest.mark.slow
def test_a_data_parallel_run_raises_no_fsdp_view_warning(launched) -> None:
    """FSDP2 warns when a sharded module returns a view (an in-place op on it would skip the module's
    pre-backward all-gather); the experts' grouped GEMM output and the blocks' outputs must not be one."""
    done, run_dir = launched["dp"]
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [done.stderr] + [log.read_text() for log in (run_dir / "logs").rglob("stderr.log")]
    assert len(logs) == 3 and "moekit rank 1/2" in "".join(logs)
    assert not [log for log in logs if "returned a view tensor" in log]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_at_a_checkpoint_and_exits_130(corpus_file, tmp_path) -> None:
    """Ctrl-C at a terminal reaches the launcher's process group: the ranks save the step they are in,
    and the launcher ends with exit code 130 and no traceback."""
    run_dir = tmp_path / "run"
    flags = ["--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run_dir), "--quiet"]
    flags += ["--train.steps", "100000", "--train.ckpt_every", "0", "--data.cache_dir", str(tmp_path / "cache")]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "moekit", "train", "--nproc", "2", *flags],
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, 180, "three training steps")
        os.killpg(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == "moekit train: interrupted", stderr[-3000:]
    step = int(re.search(r"interrupted at step (\d+); checkpoint", stderr).group(1))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:06d}"


@pytest.mark.slow
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
    overrides = {"data.path": str(corpus_file), "parallel.ep": "2", "moe.num_experts": "3", "parallel.timeout_s": "900"}
    cfg = runconfig.resolve("tiny", overrides)
    started = time.monotonic()
    with pytest.raises(LayoutError, match=r"parallel.ep=2 must divide the experts of every MoE block \(got 3\)"):
        train(cfg, tmp_path / "run", progress=False)
    # Joining would wait parallel.timeout_s (900 s) for rank 0; the bound only separates the two.
    assert time.monotonic() - started < 300


def _peer_hung_in_an_expert_exchange(rank: int, world: int, done: Path) -> None:
    cfg = runconfig.resolve("tiny", {"parallel.timeout_s": "3", "parallel.ep": "2"})
    _, mesh = init_distributed(cfg, torch.device("cpu"))
    if rank == 1:  # alive, but never joins the collective, until rank 0 is done
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"^rank 0: a collective failed.*parallel.timeout_s=3s"):
        with collective_errors(cfg.parallel.timeout_s):
            dist.all_reduce(torch.ones(1), group=mesh["ep"].get_group())
    # The mesh's sub-groups fail after parallel.timeout_s, not torch's default 30 minutes; the bound
    # only separates the two, so a busy machine cannot break it.
    assert time.monotonic() - started < 120
    done.touch()
    exit_after_rank_failure(0)


@pytest.mark.slow
def test_a_rank_hung_in_an_expert_exchange_fails_after_the_timeout(tmp_path) -> None:
    done = tmp_path / "rank0-done"
    run_ranks(_peer_hung_in_an_expert_exchange, 2, done, tmp_path=tmp_path, preload=MOEKIT)
    assert done.exists()


def _rank_pid(token: str, rank: int) -> int | None:
    """The pid of the worker of rank ``rank`` among the processes started with ``token`` in their environment."""
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"HUNG_RANK_TEST={token}".encode() in environ and f"RANK={rank}".encode() in environ:
            if b"moekit" in cmdline and b"--nproc" not in cmdline:
                return int(proc.name)
    return None


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_with_one_clear_error(corpus_file, tmp_path) -> None:
    # A real hang: rank 1 is stopped (SIGSTOP) mid-run. Rank 0 must end with the one-line error and
    # exit code 1, not a traceback or an abort from gloo's threads, and the launcher must exit 1.
    run_dir, token = tmp_path / "run", uuid.uuid4().hex
    flags = ["--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run_dir), "--quiet"]
    # 5 s: the waits of a healthy run (start-up, steps, evaluation) pass with 1 s on 2 cores; the hang is
    # what outlasts it.
    flags += ["--train.steps", "100000", "--parallel.timeout_s", "5", "--train.ckpt_every", "0"]
    env = {**ENV, "HUNG_RANK_TEST": token}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "moekit", "train", "--nproc", "2", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    rank1 = None
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 180, "two training steps")
        rank1 = _wait_for(lambda: _rank_pid(token, 1), 30, "rank 1's process")
        os.kill(rank1, signal.SIGSTOP)
        rank0_log = _wait_for(lambda: next(iter((run_dir / "logs").rglob("0/stderr.log")), None), 30, "rank 0's log")
        _wait_for(lambda: "error:" in rank0_log.read_text(), 180, "rank 0's error")
        os.kill(rank1, signal.SIGCONT)  # let it receive the launcher's SIGTERM
        _, stderr = launcher.communicate(timeout=180)
    finally:
        if rank1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, signal.SIGCONT)
        launcher.kill()
    rank0 = rank0_log.read_text()
    assert "terminate called" not in rank0 and "Traceback" not in rank0, rank0[-3000:]
    errors = [line for line in rank0.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.fullmatch(
        r".*moekit train \(rank 0\): error: rank 0: a collective failed, so another rank died or hung longer "
        r"than parallel.timeout_s=5s \(.+\)",
        errors[0],
    ), rank0[-3000:]
    assert launcher.returncode == 1, stderr[-3000:]
    assert "moekit train: error: rank 0 failed with exit code 1" in stderr, stderr[-3000:]
