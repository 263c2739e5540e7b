"""Training end to end on CPU: loss falls, resume is bitwise, failures keep what was trained."""

from __future__ import annotations

import json
import math
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moekit import runconfig
from moekit.run.layout import CheckpointError, latest_checkpoint
from moekit.run.load import load_run
from moekit.run.manifest import read_manifest
from moekit.train.loop import TrainingError, train


def tiny(corpus: Path, cache: Path, **overrides: str):
    values = {"data.path": str(corpus), "data.cache_dir": str(cache)} | overrides
    return runconfig.resolve("tiny", values)


def moekit_cli(*args: str, preexec=None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moekit", *args], capture_output=True, text=True, timeout=timeout, preexec_fn=preexec
    )


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
    with pytest.raises(TrainingError, match="resume=True"):
        train(cfg, tmp_path / "run", progress=False)
    with pytest.raises(TrainingError, match="no checkpoint"):
        train(cfg, tmp_path / "other", resume=True, progress=False)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run), "--quiet"]
    args += ["--data.cache_dir", str(tmp_path / "cache"), "--train.ckpt_every", "2"]
    assert moekit_cli(*args, "--train.steps", "2").returncode == 0
    # Resumed at a learning rate past float32's range: step 3's update makes the weights infinite
    # (step 3 saves nothing), so step 4's loss is NaN.
    proc = moekit_cli(*args, "--resume", "--train.steps", "4", "--train.lr", "1e39", "--train.warmup_steps", "0")
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert "loss is nan at step 4" in error or "loss is inf at step 4" in error, error
    assert error.endswith("step_000002"), error
    assert "Traceback" not in proc.stderr
    assert latest_checkpoint(run).name == "step_000002"  # nothing of the NaN steps was saved
    assert read_manifest(latest_checkpoint(run))["step"] == 2


def test_ctrl_c_saves_a_checkpoint_then_exits(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run), "--quiet"]
    args += ["--data.cache_dir", str(tmp_path / "cache"), "--train.steps", "100000", "--train.ckpt_every", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "moekit", *args], stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300  # generous: a loaded machine starts slowly; the steps are what count
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.1)
    assert metrics.exists() and len(metrics.read_text().splitlines()) >= 3, "the run did not start training"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "interrupted at step" in stderr and "Traceback" not in stderr
    step = int(stderr.split("interrupted at step ")[1].split(";")[0])
    assert step >= 3
    assert latest_checkpoint(run).name == f"step_{step:06d}"
    assert read_manifest(latest_checkpoint(run))["step"] == step


def _limit_file_size(max_bytes: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


def test_failed_save_keeps_previous_checkpoint(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    base = ["--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run), "--quiet"]
    base += ["--data.cache_dir", str(tmp_path / "cache"), "--train.ckpt_every", "10"]
    assert moekit_cli("train", *base, "--train.steps", "10").returncode == 0
    good = latest_checkpoint(run)
    size = max(p.stat().st_size for p in good.rglob("*.distcp"))
    # Resume with files capped below the training state's size: the step-20 save cannot complete.
    proc = moekit_cli("train", *base, "--resume", "--train.steps", "20", preexec=_limit_file_size(size // 2))
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert "could not save checkpoint" in error and "step_000010 is intact" in error
    assert latest_checkpoint(run) == good
    assert read_manifest(good)["step"] == 10
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    load_run(run)  # the previous checkpoint still loads


def test_corrupt_checkpoint_is_named(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(corpus_file, tmp_path / "cache", **{"train.steps": "2"}), run, progress=False)
    weights = latest_checkpoint(run) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt"):
        load_run(run)
    proc = moekit_cli("generate", str(run), "--max-new-tokens", "5")
    assert proc.returncode == 2 and "model.safetensors: corrupt" in proc.stderr and "Traceback" not in proc.stderr


def test_checkpoint_of_another_shape_names_keys(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(corpus_file, tmp_path / "cache", **{"train.steps": "2"}), run, progress=False)
    cfg = json.loads((run / "config.json").read_text())
    cfg["moe"]["num_experts"] = 8
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_run(run)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--moe.experts", "4"], "unrecognized arguments"),
        (["--moe.top_k", "99"], "moe.top_k=99"),
        (["--model.d_model", "abc"], "--model.d_model: cannot read 'abc'"),
        (["--data", "/no/such/file.txt"], "/no/such/file.txt"),
    ],
)
def test_bad_input_gives_one_line_error(args: list[str], message: str, tmp_path: Path) -> None:
    proc = moekit_cli("train", "--run-dir", str(tmp_path / "run"), "--quiet", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flag, message",
    [
        (["--top-p", "0"], "--top-p=0.0"),
        (["--top-k", "-3"], "--top-k=-3"),
        (["--temperature", "-1"], "--temperature=-1.0"),
    ],
)
def test_generate_rejects_bad_sampling_flags(flag: list[str], message: str, tmp_path: Path) -> None:
    proc = moekit_cli("generate", str(tmp_path), *flag)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_empty_data_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = moekit_cli("train", "--preset", "tiny", "--data", str(empty), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert proc.returncode == 2 and str(empty) in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
