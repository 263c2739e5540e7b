"""What a resume keeps: a resume that changes a setting deciding the run's data, tokens or initial
weights (``train/resume.py``) is refused by name before anything of the run changes; the settings a
resume may change take effect (``tests/e2e/test_cli_train.py``)."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest
from conftest import write_corpus
from helpers import tiny

from moekit.train.loop import train
from moekit.train.resume import KEPT

CHANGES = {
    "train.seed": "5",
    "train.batch_size": "3",
    "data.tokenizer": "char",
    "data.bpe_vocab_size": "300",
    "data.val_fraction": "0.2",
    "model.context_length": "64",
    "model.init_std": "0.05",
    "model.tie_embeddings": "false",
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("resume")
    corpus = write_corpus(tmp / "corpus.txt")
    train(tiny(corpus, tmp / "cache", **{"train.steps": "1"}), tmp / "run", progress=False)
    return corpus, tmp / "cache", tmp / "run"


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_every_kept_setting_is_tried() -> None:
    assert set(CHANGES) == set(KEPT)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_a_resume_changing_a_kept_setting_is_refused(trained, tmp_path: Path, field: str) -> None:
    corpus, cache, trained_run = trained
    run = shutil.copytree(trained_run, tmp_path / "run")
    before = _digests(run)
    cfg = tiny(corpus, cache, **{"train.steps": "2", field: CHANGES[field]})
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}=\S+: the run in .* keeps its own \(.+\) when resumed"):
        train(cfg, run, resume=True, progress=False)
    assert _digests(run) == before


@pytest.mark.slow
def test_a_resume_to_fewer_steps_than_ran_is_refused(corpus_file: Path, tmp_path: Path) -> None:
    """``moekit train --resume --train.steps 1`` on a run at step 2 would train nothing and record one
    step in config.json: refused by name, the run as it was."""
    from helpers import moekit_cli

    run = tmp_path / "run"
    train(tiny(corpus_file, tmp_path / "cache", **{"train.steps": "2"}), run, progress=False)
    before = _digests(run)
    done = moekit_cli("train", "--resume", "--run-dir", str(run), "--train.steps", "1", "--quiet")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().endswith(
        f"train.steps=1: the run in {run} is at step 2: give at least that many to resume it"
    )
    assert _digests(run) == before
