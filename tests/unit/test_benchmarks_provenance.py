"""Benchmarks' JSON names the commit that printed it: ``git describe`` of the benchmarks' checkout,
marked dirty with uncommitted changes, None outside git."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("_provenance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_commit_is_this_checkouts_and_none_outside_git(tmp_path: Path) -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCHMARKS, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("the tests run outside a git checkout")
    commit = _load(BENCHMARKS / "_provenance.py").source_commit()
    assert commit is not None and head.stdout.strip().startswith(commit.removesuffix("-dirty").rsplit("-g", 1)[-1])
    copy = tmp_path / "_provenance.py"
    shutil.copy(BENCHMARKS / "_provenance.py", copy)
    assert _load(copy).source_commit() is None


def test_the_commit_of_another_checkout_is_that_checkouts(tmp_path: Path) -> None:
    """``source_commit(tree)``: the checkout holding ``tree`` (a source tree benchmarked beside this one)."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "."], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "one"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    source_commit = _load(BENCHMARKS / "_provenance.py").source_commit
    assert source_commit(tmp_path / "src") == head.stdout.strip()
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    assert source_commit(tmp_path / "src") == head.stdout.strip() + "-dirty"
