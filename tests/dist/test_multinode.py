"""Two nodes on this machine: two torchrun agents (c10d rendezvous, 2 ranks each) train with the
two-level all-to-all, its node size inferred from the launcher; one node (one process, the same global
batch) resumes their checkpoint with their losses (fp32, 1e-5). Node-size inference refuses ranks that
are not numbered node by node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moekit
from moekit import runconfig
from moekit.parallel.mesh import LayoutError, resolve_layout

from .spawn import free_port

pytestmark = pytest.mark.dist

STEPS, HALF = 4, 2
TOL = 1e-5
SRC = str(Path(moekit.__file__).resolve().parents[1])
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


def _flags(corpus: Path, tmp: Path) -> list[str]:
    values = {
        "model.context_length": "32",
        "train.batch_size": "4",
        "train.steps": str(STEPS),
        "train.ckpt_every": str(HALF),
        "train.eval_every": "100",
        "train.eval_iters": "1",
        "train.sample_tokens": "0",
        "data.cache_dir": str(tmp / "cache"),
        "parallel.ep": "4",
        "parallel.all_to_all": "two_level",  # node_size left at 0: inferred (2 ranks per node)
    }
    flags = ["--preset", "tiny", "--data", str(corpus), "--run-dir", str(tmp / "run"), "--quiet"]
    return flags + [arg for key, value in values.items() for arg in (f"--{key}", value)]


def _losses(run: Path) -> dict[int, float]:
    """Each step's loss from metrics.jsonl (a resumed run's records replace the abandoned ones)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.slow
def test_two_nodes_train_and_one_node_resumes(corpus_file: Path, tmp_path: Path) -> None:
    port = free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    agent += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "moekit-two-nodes"]
    agent += ["--max-restarts", "0", "-m", "moekit", "train", *_flags(corpus_file, tmp_path)]
    nodes = [
        subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr[-3000:]
    run = tmp_path / "run"
    manifest = json.loads((run / "checkpoints" / f"step_{HALF:06d}" / "manifest.json").read_text())
    assert manifest["world"] == 4 and manifest["layout"] == "dp=1 x ep=4 x tp=1 x pp=1"
    assert {f"sharded/__{rank}_0.distcp" for rank in range(4)} <= manifest["files"].keys()  # every rank's shard

    # One node resumes the step-2 checkpoint in one process (grad_accum 4 keeps the global batch).
    one = tmp_path / "one-node"
    shutil.copytree(run, one)
    shutil.rmtree(one / "checkpoints" / f"step_{STEPS:06d}")
    (one / "checkpoints" / "latest").write_text(f"step_{HALF:06d}")
    argv = [sys.executable, "-m", "moekit", "train", "--resume", "--run-dir", str(one), "--quiet"]
    done = subprocess.run(
        [*argv, "--parallel.ep", "1"], capture_output=True, text=True, env=ENV, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming at step {HALF}" in done.stderr + done.stdout
    got, want = _losses(one), _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(HALF + 1, STEPS + 1):
        assert abs(got[step] - want[step]) < TOL, f"step {step}: one node {got[step]} != two nodes {want[step]}"


def _two_level(monkeypatch, rank: int, local_rank: int, node: int, local_world: int = 2):
    for key, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("GROUP_RANK", node)):
        monkeypatch.setenv(key, str(value))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    cfg = runconfig.resolve("tiny", {"parallel.ep": "4", "parallel.all_to_all": "two_level"})
    return resolve_layout(cfg, 4)


def test_node_size_is_the_ranks_per_node(monkeypatch) -> None:
    assert _two_level(monkeypatch, rank=3, local_rank=1, node=1).node_size == 2


@pytest.mark.parametrize(
    "rank, local_rank, node, local_world",
    [(1, 0, 1, 2), (2, 1, 0, 2), (3, 0, 1, 3)],
    ids=["round-robin", "interleaved", "unequal-nodes"],
)
def test_ranks_not_numbered_node_by_node_are_refused(monkeypatch, rank, local_rank, node, local_world) -> None:
    with pytest.raises(LayoutError, match=r"two_level cannot infer parallel.ep's node size: rank \d is local rank"):
        _two_level(monkeypatch, rank, local_rank, node, local_world)
