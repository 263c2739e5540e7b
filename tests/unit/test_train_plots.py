"""Plots of a run's metrics: PNGs of loss, expert load and placement, and clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import log_run, synthetic_record

from moekit.train.metrics import MetricsLogger
from moekit.train.plots import compare_runs, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path, min_bytes: int = 10_000) -> tuple[int, ...]:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > min_bytes
    return imread(path).shape


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


@pytest.mark.slow
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
