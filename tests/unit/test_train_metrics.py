"""MetricsLogger's JSONL + TensorBoard output and crash/resume handling in read_metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import log_run, synthetic_record

from moekit.train import metrics
from moekit.train.metrics import MetricsLogger, read_metrics


def test_jsonl_has_every_record_and_read_metrics_round_trips(tmp_path: Path) -> None:
    records = log_run(tmp_path, range(1, 31), tensorboard=False)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    assert read_metrics(tmp_path) == records
    assert sum("val_loss" in r for r in read_metrics(tmp_path)) == 3


def test_log_requires_an_integer_step(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger, pytest.raises(ValueError, match="integer 'step'"):
        logger.log({"loss": 1.0})


def test_numpy_and_torch_values_are_logged_as_plain_json(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log({"step": np.int64(3), "loss": torch.tensor(2.5), "load_cv": np.array([0.5, 0.25])})
    assert read_metrics(tmp_path) == [{"step": 3, "loss": 2.5, "load_cv": [0.5, 0.25]}]


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    records = log_run(tmp_path, range(1, 11), tensorboard=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 3.')  # crash mid-write: no closing brace, no newline
    assert read_metrics(tmp_path) == records


def test_corrupt_middle_line_raises_with_file_and_line(tmp_path: Path) -> None:
    log_run(tmp_path, range(1, 11), tensorboard=False)
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[4] = '{"step": 5, "loss": \n'
    path.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"metrics\.jsonl:5: corrupt"):
        read_metrics(tmp_path)


def test_resume_keeps_the_last_record_of_each_step(tmp_path: Path) -> None:
    log_run(tmp_path, range(1, 31), tensorboard=False)
    resumed = log_run(tmp_path, range(20, 31), offset=1.0, tensorboard=False)
    got = read_metrics(tmp_path)
    assert [r["step"] for r in got] == list(range(1, 31))
    assert got[19:] == resumed
    assert got[18] == synthetic_record(19)


def test_resume_drops_the_abandoned_tail(tmp_path: Path) -> None:
    # Crashed at step 30 with a checkpoint at 20; the resumed run has only reached 25 so far.
    log_run(tmp_path, range(1, 31), tensorboard=False)
    log_run(tmp_path, range(21, 26), offset=1.0, tensorboard=False)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 26))


def test_resume_after_a_crash_mid_write_cuts_the_partial_line(tmp_path: Path) -> None:
    log_run(tmp_path, range(1, 11), tensorboard=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "lo')
    log_run(tmp_path, range(11, 16), tensorboard=False)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 16))


def test_tensorboard_events_hold_scalars_per_layer_and_histograms(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_run(tmp_path, range(1, 31))
    log_run(tmp_path, range(20, 26), offset=1.0)  # resumed: the old 20..30 must disappear
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir), size_guidance={"histograms": 0})  # 0: keep every event
    acc.Reload()
    tags = acc.Tags()
    assert {"loss", "lr", "val_loss", "load_cv/layer0", "load_max_over_mean/layer1"} <= set(tags["scalars"])
    assert {"expert_load/layer0", "expert_load/layer1"} <= set(tags["histograms"])
    # per-expert histograms every HISTOGRAM_EVERY (10) steps and at evaluations (also every 10th here)
    assert [e.step for e in acc.Histograms("expert_load/layer0")] == [10, 20]
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, 26))
    assert [e.value for e in loss] == pytest.approx(
        [synthetic_record(s, offset=1.0 if s >= 20 else 0.0)["loss"] for s in range(1, 26)]
    )


def test_missing_tensorboard_warns_once_and_keeps_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    monkeypatch.setattr(metrics, "_warned_no_tensorboard", False)
    log_run(tmp_path / "a", range(1, 4))
    log_run(tmp_path / "b", range(1, 4))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensorboard is not installed" in err[0]
    assert len(read_metrics(tmp_path / "b")) == 3
    assert not (tmp_path / "b" / "tensorboard").exists()
