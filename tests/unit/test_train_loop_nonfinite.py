"""Non-finite numbers in training: a NaN gradient skips its update, repeated ones stop the run, and a
checkpoint is never written from non-finite weights. Every run is a real CPU run of the tiny preset;
the NaN comes from a tensor hook on one parameter of the model being trained."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from nan_watch import Watch
from torch import Tensor

from moekit import runconfig
from moekit.run.layout import latest_checkpoint
from moekit.run.load import load_run
from moekit.run.manifest import read_manifest
from moekit.runconfig import RunConfig
from moekit.train.loop import TrainingError, train
from moekit.train.metrics import read_metrics


def tiny(corpus: Path, cache: Path, **overrides: str) -> RunConfig:
    values = {"data.path": str(corpus), "data.cache_dir": str(cache), "moe.bias_update_rate": "0.01"} | overrides
    return runconfig.resolve("tiny", values)


def same(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nan_gradient_skips_the_update_and_training_goes_on(
    corpus_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    with Watch({4}) as watch:
        result = train(
            tiny(corpus_file, tmp_path / "cache", **{"train.steps": "8"}), run, progress=False, on_step=watch.on_step
        )
    assert result.steps == 8 and result.skipped_steps == 1
    # The skipped step changed nothing: weights, router biases and every optimizer moment are bitwise those of step 3,
    assert same(watch.states[4], watch.states[3])
    assert all(torch.equal(a, b) for a, b in zip(watch.adam[4], watch.adam[3], strict=True))
    # while an ordinary step changes all of them (so the comparison above can fail).
    assert not any(torch.equal(watch.states[3][k], watch.states[2][k]) for k in watch.states[3] if "expert_bias" in k)
    assert not torch.equal(watch.states[5]["embed.weight"], watch.states[4]["embed.weight"])
    assert watch.optimizer_steps == 7  # optimizer.step() ran on every step but the fourth
    assert [watch.adam_steps[s] for s in range(1, 9)] == [1, 2, 3, 3, 4, 5, 6, 7]
    records = read_metrics(run)
    assert [r["skipped"] for r in records] == [False, False, False, True, False, False, False, False]
    assert [r["skipped_steps"] for r in records] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert math.isnan(records[3]["grad_norm"])
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records[4:])
    assert "gradient norm is nan at step 4: update skipped" in capsys.readouterr().err
    assert read_manifest(latest_checkpoint(run))["skipped_steps"] == 1


@pytest.mark.slow
def test_consecutive_nan_gradients_stop_naming_the_field(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny(corpus_file, tmp_path / "cache", **{"train.steps": "10", "train.ckpt_every": "2"})
    with Watch({4, 5, 6, 7}) as watch, pytest.raises(TrainingError) as err:
        train(cfg, run, progress=False, on_step=watch.on_step)
    message = str(err.value)
    assert "\n" not in message
    assert "at step 6" in message and "train.max_nonfinite_steps=3" in message, message
    assert message.endswith("step_000004"), message  # the save after the skipped step 4 holds step 3's weights
    assert latest_checkpoint(run).name == "step_000004"
    assert read_manifest(latest_checkpoint(run))["nonfinite_streak"] == 1
    assert same(load_run(run).model.state_dict(), watch.states[3])
    assert [r["skipped_steps"] for r in read_metrics(run)] == [0, 0, 0, 1, 2, 3]


@pytest.mark.slow
def test_resume_after_a_skip_equals_uninterrupted(corpus_file: Path, tmp_path: Path) -> None:
    steps = {"train.steps": "10", "train.ckpt_every": "2", "train.keep_checkpoints": "5"}
    cfg = tiny(corpus_file, tmp_path / "cache", **steps)
    with Watch({4, 6}):
        full = train(cfg, tmp_path / "full", progress=False)
    assert full.skipped_steps == 2
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "full", half)
    for name in ("step_000008", "step_000010"):
        shutil.rmtree(half / "checkpoints" / name)
    (half / "checkpoints" / "latest").write_text("step_000006")
    resumed = train(cfg, half, resume=True, progress=False)
    assert resumed.losses == full.losses[6:] and resumed.skipped_steps == 2  # exact float equality
    assert [r["skipped_steps"] for r in read_metrics(half)] == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    a, b = load_run(tmp_path / "full").model.state_dict(), load_run(half).model.state_dict()
    assert same(a, b)


def test_resume_keeps_the_nonfinite_streak(corpus_file: Path, tmp_path: Path) -> None:
    cfg = tiny(corpus_file, tmp_path / "cache", **{"train.steps": "10", "train.ckpt_every": "2"})
    run = tmp_path / "run"
    with Watch({5, 6, 7}), pytest.raises(TrainingError, match="3 steps in a row at step 7"):
        train(cfg, run, progress=False)
    assert read_manifest(latest_checkpoint(run))["nonfinite_streak"] == 2  # step 6: skips 5 and 6
    # Resumed after two skips in a row, one more is the third: the run stops at the same step.
    with Watch({7}, first_step=7), pytest.raises(TrainingError, match="3 steps in a row at step 7"):
        train(cfg, run, resume=True, progress=False)


def test_nonfinite_weights_are_never_saved(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(corpus_file, tmp_path / "cache", **{"train.steps": "2", "train.ckpt_every": "1"}), run, progress=False)
    # A learning rate past float32's range turns finite gradients into infinite weights at step 3;
    # the loss of step 3 and its gradient norm are still finite, so only the check before saving sees it.
    overflow = {"train.steps": "4", "train.ckpt_every": "1", "train.lr": "1e39", "train.warmup_steps": "0"}
    with pytest.raises(TrainingError) as err:
        train(tiny(corpus_file, tmp_path / "cache", **overflow), run, resume=True, progress=False)
    message = str(err.value)
    assert message.startswith("weights are not finite after step 3: checkpoint not saved"), message
    assert message.endswith("step_000002") and "\n" not in message, message
    assert latest_checkpoint(run).name == "step_000002"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    weights = load_run(run).model.state_dict()
    assert all(w.isfinite().all() for w in weights.values())


def _nan_on_rank_one(rank: int, world: int, corpus: Path, tmp: Path) -> None:
    cfg = tiny(corpus, tmp / "cache", **{"train.steps": "4", "parallel.ep": "2"})
    with Watch({3} if rank == 1 else set()) as watch:
        result = train(cfg, tmp / "run", progress=False, on_step=watch.on_step)
    assert result.steps == 4 and result.skipped_steps == 1, (rank, result)
    assert same(watch.states[3], watch.states[2]), rank  # rank 0 skipped rank 1's NaN step too
    assert watch.optimizer_steps == 3, rank


def test_every_rank_skips_a_step_that_is_nan_on_one(corpus_file: Path, tmp_path: Path) -> None:
    from dist.spawn import MOEKIT, run_ranks  # the tests directory is on sys.path (rootdir conftest)

    run_ranks(_nan_on_rank_one, 2, corpus_file, tmp_path, tmp_path=tmp_path, preload=MOEKIT)
    assert [r["skipped"] for r in read_metrics(tmp_path / "run")] == [False, False, True, False]
