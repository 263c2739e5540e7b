"""Bad input through the real command line: one line naming the field or file, exit 2, nothing lost.

Each case runs ``python -m moekit`` as a user would and checks the whole contract: the exit code, a
single line on stderr that names what is wrong, no traceback, and the run directory byte for byte as
it was (or still absent, for a run that never started).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_corpus

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _manifest(run: Path) -> Path:
    return next((run / "checkpoints").glob("step_*/manifest.json"))


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


PLAN = ["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100"]

# (id, argv with {run} {new} {tmp} placeholders, a file edit before the call, the text the error must name)
CASES = [
    ("device", ["train", "--device", "foo", "--run-dir", "{new}"], None, "--device"),
    ("nproc-zero", ["train", "--nproc", "0", "--run-dir", "{new}"], None, "--nproc"),
    ("flag-type", ["train", "--train.steps", "x", "--run-dir", "{new}"], None, "--train.steps"),
    ("unknown-flag", ["train", "--bogus", "--run-dir", "{new}"], None, "--bogus"),
    ("unknown-field", ["train", "--moe.nope", "1", "--run-dir", "{new}"], None, "--moe.nope"),
    ("unknown-preset", ["train", "--preset", "nosuch", "--run-dir", "{new}"], None, "--preset"),
    ("nan-lr", ["train", "--train.lr", "nan", "--run-dir", "{new}"], None, "train.lr"),
    ("inf-lr", ["train", "--train.lr", "inf", "--run-dir", "{new}"], None, "train.lr=inf: must be a finite number"),
    ("weight-decay", ["train", "--train.weight_decay", "-1", "--run-dir", "{new}"], None, "train.weight_decay=-1.0"),
    ("beta1", ["train", "--train.beta1", "1.5", "--run-dir", "{new}"], None, "train.beta1=1.5: must be in [0, 1)"),
    ("rope-theta", ["train", "--model.rope_theta", "0", "--run-dir", "{new}"], None, "model.rope_theta=0.0: must be"),
    ("missing-data", ["train", "--data", "{tmp}/missing.txt", "--run-dir", "{new}"], None, "missing.txt"),
    ("toml-string-lr", ["train", "--preset", "{tmp}/lr.toml", "--run-dir", "{new}"], "lr", "train.lr"),
    ("toml-string-float", ["train", "--preset", "{tmp}/cf.toml", "--run-dir", "{new}"], "cf", "moe.capacity_factor"),
    ("toml-syntax", ["train", "--preset", "{tmp}/broken.toml", "--run-dir", "{new}"], "broken", "broken.toml"),
    (
        "run-exists",
        ["train", "--run-dir", "{run}"],
        None,
        "--run-dir={tmp}/run: already holds a trained run; pass --resume, or choose another directory",
    ),
    (
        "resume-no-checkpoint",
        ["train", "--resume", "--run-dir", "{run}"],
        "no-checkpoint",
        "--resume: {tmp}/run has no checkpoint to resume from",
    ),
    (
        "resume-batch",
        ["train", "--resume", "--run-dir", "{run}", "--train.grad_accum", "2"],
        None,
        "--train.grad_accum",
    ),
    ("resume-no-dir", ["train", "--resume"], None, "--run-dir"),
    # the vocabulary is the tokenizer's: a typed one would be dropped
    ("vocab-new", ["train", "--model.vocab_size", "999", "--run-dir", "{new}"], None, "--model.vocab_size: a run"),
    (
        "vocab-resume",
        ["train", "--resume", "--run-dir", "{run}", "--model.vocab_size", "99"],
        None,
        "--model.vocab_size",
    ),
    # a resume keeps what decides its data (every such field: tests/unit/test_train_resume.py)
    ("resume-seed", ["train", "--resume", "--run-dir", "{run}", "--train.seed", "5"], None, "train.seed=5"),
    ("config-type", ["generate", "{run}", "--max-new-tokens", "2"], "config", "config.json"),
    ("manifest-no-files", ["generate", "{run}", "--max-new-tokens", "2"], "no-files", "'files'"),
    ("manifest-not-json", ["generate", "{run}", "--max-new-tokens", "2"], "not-json", "manifest.json"),
    ("export-no-files", ["export", "{run}", "--out", "{new}"], "no-files", "'files'"),
    ("weights-cut", ["generate", "{run}", "--max-new-tokens", "2"], "cut", "model.safetensors"),
    ("nan-temperature", ["generate", "{run}", "--temperature", "nan"], None, "--temperature"),
    ("not-a-run", ["generate", "{tmp}"], None, "config.json"),
    ("export-format", ["export", "{run}", "--out", "{new}", "--format", "onnx"], None, "--format"),
    # library errors name the argument (batch_size=0, init=..., out=...); the CLI names the flag typed
    ("batch-size", ["generate", "{run}", "--batch-size", "0"], None, "--batch-size=0"),
    ("top-k", ["generate", "{run}", "--top-k", "-3"], None, "--top-k=-3: must be >= 0 (0 = all tokens)"),
    ("budget-small", ["generate", "{run}", "--memory-budget", "10KB"], None, "--memory-budget=10.0 KB"),
    ("init-resume", ["train", "--init", "{run}", "--resume", "--run-dir", "{new}"], None, "combined with --resume"),
    ("resume-nothing", ["train", "--resume", "--run-dir", "{new}"], None, "new/config.json: cannot read"),
    (
        "nnodes",
        ["train", "--nproc", "1", "--nnodes", "2", "--run-dir", "{new}"],
        None,
        "--nnodes=2: needs --rdzv-endpoint",
    ),
    (
        "launcher-alone",
        ["train", "--max-restarts", "2", "--run-dir", "{new}"],
        None,
        "--max-restarts: a flag of the launcher",
    ),
    ("bad-latest", ["train", "--resume", "--run-dir", "{run}"], "bad-latest", "(pass --fallback to resume from"),
    ("export-onto-run", ["export", "{run}", "--out", "{run}"], None, "--out="),
    (
        "host-budget",
        ["train", "--train.memory_budget", "1MB", "--train.host_budget", "lots", "--run-dir", "{new}"],
        None,
        "train.host_budget='lots': give a size",
    ),
    ("run-dir-file", ["train", "--run-dir", "{tmp}/a-file"], "a-file", "is a file"),
    (
        "offload-dir-file",
        ["train", "--train.memory_budget", "1MB", "--train.offload_dir", "{tmp}/a-file", "--run-dir", "{new}"],
        "a-file",
        "train.offload_dir={tmp}/a-file: is a file, not a directory",
    ),
    (
        "resume-budget-tiny",  # refused once the experts' size is known: no offload/ left in the run
        ["train", "--resume", "--run-dir", "{run}", "--data", "{tmp}/corpus.txt", "--train.memory_budget", "1KB"],
        "corpus",
        "train.memory_budget='1KB': offloaded training needs at least",
    ),
    ("plot-out-file", ["plot", "{run}", "--out", "{tmp}/a-file"], "a-file", "--out="),
    ("export-out-file", ["export", "{run}", "--out", "{tmp}/a-file"], "a-file", "--out="),
    ("plan-loads", [*PLAN, "--loads", "{tmp}/none"], None, "--loads="),  # before the table is printed
    ("plan-steps-left", [*PLAN, "--steps-left", "-5"], None, "--steps-left=-5"),
    (
        "host-budget-alone",
        ["train", "--train.host_budget", "1MB", "--run-dir", "{new}"],
        None,
        "train.host_budget='1MB': needs train.memory_budget",
    ),
]

EDITS = {
    "lr": lambda run, tmp: _write(tmp / "lr.toml", '[train]\nlr = "x"\n'),
    "cf": lambda run, tmp: _write(tmp / "cf.toml", '[moe]\ncapacity_factor = "1.25"\n'),
    "broken": lambda run, tmp: _write(tmp / "broken.toml", "[train\nlr = 1\n"),
    "a-file": lambda run, tmp: _write(tmp / "a-file", "not a directory\n"),
    "no-checkpoint": lambda run, tmp: shutil.rmtree(run / "checkpoints"),  # a run stopped before its first one
    "bad-latest": lambda run, tmp: _write(run / "checkpoints" / "latest", "step_999999\n"),
    "corpus": lambda run, tmp: write_corpus(tmp / "corpus.txt"),
    "config": lambda run, tmp: _edit_json(run / "config.json", lambda c: c["train"].update(lr="x")),
    "no-files": lambda run, tmp: _edit_json(_manifest(run), lambda m: m.pop("files")),
    "not-json": lambda run, tmp: _manifest(run).write_text("{"),
    "cut": lambda run, tmp: (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]))(
        _manifest(run).parent / "model.safetensors"
    ),
}


def _snapshot(root: Path) -> dict[str, str] | None:
    """Every file's digest and every directory (an empty one left behind counts) under ``root``."""
    if not root.exists():
        return None
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "directory"
        for p in root.rglob("*")
    }


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory, write_run) -> Path:
    return write_run(tmp_path_factory.mktemp("bad-input") / "run")


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "edit", "named"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_clear_line_and_loses_nothing(pristine_run, tmp_path, argv, edit, named) -> None:
    run, new = tmp_path / "run", tmp_path / "new"
    shutil.copytree(pristine_run, run)
    if edit:
        EDITS[edit](run, tmp_path)
    args = [a.format(run=run, new=new, tmp=tmp_path) for a in argv]
    before = _snapshot(run)
    done = subprocess.run(
        [sys.executable, "-m", "moekit", *args], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=600
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"moekit {args[0]}: error: ") or lines[0].startswith("moekit: error: "), lines[0]
    assert named.format(tmp=tmp_path) in lines[0], lines[0]
    assert _snapshot(run) == before, "the run directory changed"
    assert not new.exists(), "a run directory was created"
