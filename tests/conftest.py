"""Shared fixtures: a small real-text corpus and tiny run directories, written into the test's own directory.

Layout: the tests mirror the package.
- unit/test_<module>.py tests ``moekit/<module>.py`` and unit/test_<subpackage>_<module>.py tests
  ``moekit/<subpackage>/<module>.py`` (test_run_checkpoint.py: run/checkpoint.py); a module with two
  files adds a topic (test_train_loop_nonfinite.py). test_imports.py checks the package as a whole.
- e2e/test_cli_<command>.py drives one ``moekit`` command as a user does (``python -m moekit`` or
  ``moekit.cli.main``); e2e/test_bad_input.py is the table of bad input across commands.
- dist/ spawns gloo ranks; parity/ compares with transformers (both named by what they check; a
  parity test may drive the CLI when its input is a transformers model).
- cuda/ runs where a CUDA device is (skipped elsewhere): the GPU paths against CPU references.
Helpers used by more than one file live in helpers.py, fixtures here.

Tiers: ``python -m pytest`` runs the fast tier (pyproject's ``-m 'not slow'``), ``-m slow`` the rest and
``--all`` both. A test is marked where it is written (``pytestmark`` for a whole file, a decorator or
``pytest.param(..., marks=pytest.mark.slow)`` for one case), never listed here.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from moekit import runconfig
from moekit.kernels import ISA_VARIABLE, ISAS
from moekit.model import Transformer
from moekit.run.checkpoint import save_checkpoint
from moekit.tokenizer import ByteTokenizer


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", help="run every tier: the fast one and the tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--all"):
        config.option.markexpr = ""  # no mark filter: pyproject's "not slow" no longer applies
    # moekit.kernels builds into a directory of this test run's (children inherit it), not the user's cache
    config._kernel_cache = tempfile.mkdtemp(prefix="moekit-kernels-")
    os.environ["MOEKIT_CACHE"] = config._kernel_cache
    os.environ.pop(ISA_VARIABLE, None)  # each test picks its build (kernel_isa), not the user's setting


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(getattr(config, "_kernel_cache", ""), ignore_errors=True)


SENTENCE = (
    "the king and queen of the castle walked along the river to see the ships that came from the "
    "north with wool and wine while the people of the town sang songs about the old war and the "
    "brave soldiers who fought for their home and their children"
)
WORDS = SENTENCE.split()


def write_corpus(path: Path, n_lines: int = 600, seed: int = 0) -> Path:
    """Sentences of real words with structure a tiny model can learn in a few steps."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        start = rng.randrange(len(WORDS) - 8)
        lines.append(f"{i % 7}: " + " ".join(WORDS[start : start + rng.randint(4, 8)]) + ".")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(params=list(ISAS))
def kernel_isa(request, monkeypatch) -> str:
    """Each build of ``moekit.kernels`` this CPU runs, in turn (``$MOEKIT_MAX_CPU_ISA``, the library found
    anew), so that a CPU with AVX-512 checks the AVX2 build too; a build the CPU cannot run is skipped,
    and so is every build where no compiler is found (a failed build with a compiler fails)."""
    from moekit import kernels

    if request.param not in kernels.runnable_isas():
        pytest.skip(f"this CPU does not run the {request.param} build")
    monkeypatch.setenv(kernels.ISA_VARIABLE, request.param)
    kernels._library.cache_clear()
    if not kernels.rows_available() and shutil.which(os.environ.get("CC", "cc").split()[0]) is None:
        pytest.skip(f"no C compiler: {kernels.rows_unavailable_reason()}")
    yield request.param
    monkeypatch.undo()
    kernels._library.cache_clear()


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")


RUN_OVERRIDES = {"model.n_layers": "3", "moe.num_experts": "6", "model.context_length": "48"}


def _write_run(run_dir: Path, **overrides: str) -> Path:
    """A run directory like ``moekit train`` writes: config, tokenizer, one checkpoint."""
    cfg = runconfig.resolve("tiny", {**RUN_OVERRIDES, **overrides})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    with torch.no_grad():  # sharpen the random model so greedy choices are not near-ties
        model.lm_head.weight.mul_(20.0)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    ByteTokenizer().save(run_dir)
    save_checkpoint(run_dir, 1, model, {}, keep=1)
    return run_dir


@pytest.fixture(scope="session")
def write_run():
    """``write_run(run_dir, **overrides)``: a tiny MoE run directory with one checkpoint."""
    return _write_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, write_run) -> Path:
    """One tiny run directory per test module, read (never written) by its tests."""
    return write_run(tmp_path_factory.mktemp("offload") / "run")
