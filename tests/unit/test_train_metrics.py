"""MetricsLogger's JSONL + TensorBoard output, crash/resume handling in read_metrics, and the PNG plots."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from moekit.train import metrics
from moekit.train.metrics import MetricsLogger, read_metrics
from moekit.train.plots import compare_runs, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_record(step: int, moe: bool = True, offset: float = 0.0) -> dict[str, Any]:
    """A trainer-like record: 2 MoE layers of 4 experts, layer 0 drifting from skewed toward uniform."""
    record: dict[str, Any] = {
        "step": step,
        "loss": 6.0 * math.exp(-step / 15) + 3.0 + 0.05 * math.sin(step) + offset,
        "lr": 6e-4 * min(1.0, step / 5),
        "tokens_per_s": 5400.0,
        "mfu": 0.031,
    }
    if moe:
        skew = 0.3 * math.exp(-step / 10)
        layer0 = [0.25 + skew, 0.25 - skew / 3, 0.25 - skew / 3, 0.25 - skew / 3]
        layer1 = [0.26, 0.24, 0.25, 0.25]
        record |= {
            "aux_loss": 1.0 + skew,
            "z_loss": 0.35,
            "dropped_frac": 0.0,
            "load_max_over_mean": [max(layer0) * 4, max(layer1) * 4],
            "load_cv": [skew, 0.01],
            "expert_load": [layer0, layer1],
        }
    if step % 10 == 0:
        record["val_loss"] = record["loss"] + 0.1
    return record


def log_run(run_dir: Path, steps: range, moe: bool = True, offset: float = 0.0, tensorboard: bool = True) -> list[dict]:
    records = [synthetic_record(s, moe, offset) for s in steps]
    with MetricsLogger(run_dir, tensorboard=tensorboard) as logger:
        for r in records:
            logger.log(r)
    return records


def assert_png(path: Path, min_bytes: int = 10_000) -> tuple[int, ...]:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > min_bytes
    return imread(path).shape


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


def test_plot_run_writes_loss_and_expert_load_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log_run(tmp_path, range(1, 31), tensorboard=False)
    paths = plot_run(tmp_path)
    assert paths == [tmp_path / "plots" / "loss.png", tmp_path / "plots" / "expert_load.png"]
    for path in paths:
        height, width, channels = assert_png(path)
        assert width >= 1000 and height >= 500 and channels in (3, 4)


def test_plot_run_of_a_dense_run_writes_only_the_loss(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log_run(tmp_path / "run", range(1, 31), moe=False, tensorboard=False)
    out = tmp_path / "out"
    assert plot_run(tmp_path / "run", out) == [out / "loss.png"]
    assert sorted(p.name for p in out.iterdir()) == ["loss.png"]
    assert_png(out / "loss.png")


@pytest.mark.parametrize("content", [None, ""])
def test_plot_run_without_metrics_names_the_file(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ValueError, match=r"metrics\.jsonl"):
        plot_run(tmp_path)


def test_plot_run_without_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_run(tmp_path, range(1, 4), tensorboard=False)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plot_run(tmp_path)


def test_compare_runs_draws_one_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log_run(tmp_path / "dense", range(1, 31), moe=False, offset=0.2, tensorboard=False)
    log_run(tmp_path / "moe", range(1, 31), tensorboard=False)
    out = compare_runs(
        {"dense": tmp_path / "dense", "moe": tmp_path / "moe"}, tmp_path / "cmp" / "loss.png", "dense vs MoE"
    )
    assert out == tmp_path / "cmp" / "loss.png"
    assert_png(out)
    with pytest.raises(ValueError, match="at least one run"):
        compare_runs({}, tmp_path / "x.png", "nothing")


def test_plot_run_of_an_expert_parallel_run_adds_placement(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 31):
            placed = step > 10  # re-placed at step 10: the ranks even out
            logger.log(
                synthetic_record(step)
                | {
                    "rank_load": [100.0, 100.0] if placed else [150.0, 50.0],
                    "rank_imbalance": 1.0 if placed else 1.5,
                    "placement_moves": int(step == 10) * 2,
                    "placement_bytes": 4e6 if step == 10 else 0.0,
                    "placement_s": 0.02 if step == 10 else 0.001,
                }
            )
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "expert_load.png", "placement.png"]
    assert_png(paths[-1])
