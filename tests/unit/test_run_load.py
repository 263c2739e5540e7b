"""Loading a run refuses a checkpoint that does not fit the run's config, naming the keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny

from moekit.run.layout import CheckpointError
from moekit.run.load import load_run
from moekit.train.loop import train


def test_checkpoint_of_another_shape_names_keys(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(corpus_file, tmp_path / "cache", **{"train.steps": "2"}), run, progress=False)
    cfg = json.loads((run / "config.json").read_text())
    cfg["moe"]["num_experts"] = 8
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_run(run)
