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
