"""``moekit train`` as a user runs it (a subprocess): help, bad input, non-finite numbers, Ctrl-C and a
failed save each end with one clear line and keep the last good checkpoint."""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import moekit_cli, moekit_clis, tiny

from moekit.run.layout import latest_checkpoint
from moekit.run.load import load_run
from moekit.run.manifest import read_manifest
from moekit.train.loop import train
from moekit.train.metrics import read_metrics


def test_exploded_weights_stop_after_max_nonfinite_steps(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run), "--quiet"]
    args += ["--data.cache_dir", str(tmp_path / "cache"), "--train.lr", "1e30", "--train.warmup_steps", "0"]
    args += ["--train.ckpt_every", "1", "--train.grad_clip", "0", "--train.max_nonfinite_steps", "2"]
    # Step 1's update leaves huge finite weights; their gradients overflow from step 2 on.
    proc = subprocess.run([sys.executable, "-m", "moekit", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "gradient norm is nan at step 2: update skipped" in proc.stderr
    assert "2 steps in a row at step 3 (train.max_nonfinite_steps=2)" in lines[-1], lines[-1]
    assert lines[-1].endswith("step_000002") and latest_checkpoint(run).name == "step_000002"
    assert all(w.isfinite().all() for w in load_run(run).model.state_dict().values())


def test_help_lists_presets_and_fields() -> None:
    out = subprocess.run([sys.executable, "-m", "moekit", "train", "--help"], capture_output=True, text=True).stdout
    assert "--moe.num_experts" in out and "routed experts in the layer" in out
    assert "--model.n_layers" in out and "presets: " in out and "default, " in out.split("presets: ")[1]
    top = subprocess.run([sys.executable, "-m", "moekit", "--help"], capture_output=True, text=True).stdout
    for command in ("train", "generate", "plot"):
        assert command in top


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run), "--quiet"]
    args += ["--data.cache_dir", str(tmp_path / "cache"), "--train.ckpt_every", "2"]
    assert moekit_cli(*args, "--train.steps", "2").returncode == 0
    # Resumed at a learning rate past float32's range: step 3's update makes the weights infinite
    # (step 3 saves nothing), so step 4's loss is NaN.
    proc = moekit_cli(*args, "--resume", "--train.steps", "4", "--train.lr", "1e39", "--train.warmup_steps", "0")
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert "loss is nan at step 4" in error or "loss is inf at step 4" in error, error
    assert error.endswith("step_000002"), error
    assert "Traceback" not in proc.stderr
    assert latest_checkpoint(run).name == "step_000002"  # nothing of the NaN steps was saved
    assert read_manifest(latest_checkpoint(run))["step"] == 2


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_then_exits(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run), "--quiet"]
    args += ["--data.cache_dir", str(tmp_path / "cache"), "--train.steps", "100000", "--train.ckpt_every", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "moekit", *args], stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300  # generous: a loaded machine starts slowly; the steps are what count
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.1)
    assert metrics.exists() and len(metrics.read_text().splitlines()) >= 3, "the run did not start training"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "interrupted at step" in stderr and "Traceback" not in stderr
    step = int(stderr.split("interrupted at step ")[1].split(";")[0])
    assert step >= 3
    assert latest_checkpoint(run).name == f"step_{step:06d}"
    assert read_manifest(latest_checkpoint(run))["step"] == step


def _limit_file_size(max_bytes: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


@pytest.mark.slow
def test_failed_save_keeps_previous_checkpoint(corpus_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    base = ["--preset", "tiny", "--data", str(corpus_file), "--run-dir", str(run), "--quiet"]
    base += ["--data.cache_dir", str(tmp_path / "cache"), "--train.ckpt_every", "10"]
    assert moekit_cli("train", *base, "--train.steps", "10").returncode == 0
    good = latest_checkpoint(run)
    size = max(p.stat().st_size for p in good.rglob("*.distcp"))
    # Resume with files capped below the training state's size: the step-20 save cannot complete.
    proc = moekit_cli("train", *base, "--resume", "--train.steps", "20", preexec=_limit_file_size(size // 2))
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert "could not save checkpoint" in error and "step_000010 is intact" in error
    assert latest_checkpoint(run) == good
    assert read_manifest(good)["step"] == 10
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    load_run(run)  # the previous checkpoint still loads


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--moe.experts", "4"], "unrecognized arguments"),
        (["--moe.top_k", "99"], "moe.top_k=99"),
        (["--model.d_model", "abc"], "--model.d_model: cannot read 'abc'"),
        (["--data", "/no/such/file.txt"], "/no/such/file.txt"),
    ],
)
def test_bad_input_gives_one_line_error(args: list[str], message: str, tmp_path: Path) -> None:
    proc = moekit_cli("train", "--run-dir", str(tmp_path / "run"), "--quiet", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_empty_data_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = moekit_cli("train", "--preset", "tiny", "--data", str(empty), "--run-dir", str(tmp_path / "r"), "--quiet")
    assert proc.returncode == 2 and str(empty) in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_offloaded_training_runs_from_the_command_line(corpus_file: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ["train", "--preset", "tiny", "--data", str(corpus_file), "--quiet", "--data.cache_dir", str(tmp_path / "c")]
    args += ["--train.steps", "2", "--train.eval_every", "2", "--train.sample_tokens", "0"]
    proc = moekit_cli(
        *args, "--run-dir", str(tmp_path / "run"), "--train.memory_budget", "1MB", "--train.offload_dir", str(state)
    )
    assert proc.returncode == 0, proc.stderr
    assert latest_checkpoint(tmp_path / "run").name == "step_000002"
    assert not state.exists(), "the offloaded state and the directory made for it are removed when training ends"
    bad = moekit_cli(*args, "--run-dir", str(tmp_path / "bad"), "--train.memory_budget", "lots")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == (
        "moekit train: error: train.memory_budget='lots': give a size such as 512MB, 2GiB or a byte count"
    )


@pytest.mark.slow
def test_two_runs_given_one_offload_dir_cannot_share_it(corpus_file: Path, tmp_path: Path) -> None:
    """Run A and run B are given the same ``--train.offload_dir``; B is started while A holds its file
    (A paused there, so that B meets it whatever the machine's load). B is refused with one line naming
    the field and writes nothing, and A, let go on, trains exactly as run C, started beside it with the
    same settings and its own directory, does."""
    shared, own = tmp_path / "shared", tmp_path / "own"
    args = ["train", "--preset", "tiny", "--data", str(corpus_file), "--quiet", "--data.cache_dir", str(tmp_path / "c")]
    args += ["--train.steps", "3", "--train.eval_every", "3", "--train.sample_tokens", "0"]
    args += ["--train.memory_budget", "800KB"]

    def start(run: str, state: Path, *more: str) -> subprocess.Popen:
        argv = [*args, "--run-dir", str(tmp_path / run), "--train.offload_dir", str(state), *more]
        return subprocess.Popen([sys.executable, "-m", "moekit", *argv], stderr=subprocess.PIPE, text=True)

    a, c = start("a", shared), start("c", own)
    held = shared / "experts-rank0.bin"
    deadline = time.monotonic() + 300
    while not held.exists() and a.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    a.send_signal(signal.SIGSTOP)
    try:
        assert held.exists(), "run A did not claim its offload file"
        inode = held.stat().st_ino
        b = moekit_cli(*args, "--run-dir", str(tmp_path / "b"), "--train.offload_dir", str(shared), "--train.seed", "2")
        assert held.stat().st_ino == inode, "run B replaced run A's file"
    finally:
        a.send_signal(signal.SIGCONT)
    assert b.returncode == 2 and "Traceback" not in b.stderr, b.stderr
    assert b.stderr.strip().splitlines() == [
        f"moekit train: error: train.offload_dir={shared}: experts-rank0.bin is in use by another run; "
        "give each run its own train.offload_dir"
    ]
    assert not (tmp_path / "b").exists(), "the refused run wrote nothing"
    assert a.wait(timeout=600) == 0 and c.wait(timeout=600) == 0, a.stderr.read() + c.stderr.read()
    losses = {run: [r["loss"] for r in read_metrics(tmp_path / run)] for run in ("a", "c")}
    assert len(losses["a"]) == 3 and losses["a"] == losses["c"]
    assert not shared.exists() and not own.exists()


@pytest.mark.slow
@pytest.mark.skipif(
    subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0,
    reason="needs unshare (a mount namespace) to mount a read-only or a full filesystem",
)
@pytest.mark.parametrize(
    ("mount", "named"),
    [("ro", "cannot hold the offloaded expert state: Read-only file system"), ("size=16k", "No space left on device")],
    ids=["read-only", "full"],
)
def test_an_offload_dir_on_a_read_only_or_full_disk_is_one_line(
    corpus_file: Path, tmp_path: Path, mount: str, named: str
) -> None:
    """The offload directory on a tmpfs mounted read-only, or too small for the run's expert state (the
    file takes its room at start-up): one line naming ``train.offload_dir``, nothing left in it, no
    checkpoint."""
    disk, run = tmp_path / "disk", tmp_path / "run"
    disk.mkdir()
    args = ["train", "--preset", "tiny", "--data", str(corpus_file), "--quiet", "--data.cache_dir", str(tmp_path / "c")]
    args += ["--run-dir", str(run), "--train.memory_budget", "1MB", "--train.offload_dir", str(disk / "state")]
    script = f'mount -t tmpfs -o {mount} tmpfs "$1" || exit 99; shift; "$@"; code=$?; ls -A "{disk}"; exit $code'
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(disk), sys.executable, "-m", "moekit", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moekit train: error: train.offload_dir={disk / 'state'}: ")
    assert named in lines[0], lines[0]
    assert done.stdout == "", f"left on the offload disk: {done.stdout}"
    assert latest_checkpoint(run) is None


@pytest.mark.slow
def test_a_failed_resume_keeps_the_runs_config_and_tokenizer(corpus_file: Path, tmp_path: Path) -> None:
    """A resume whose checkpoint does not fit its flags (and whose new text has other characters) fails
    before anything of the run is rewritten: its config and its own tokenizer are kept, and a plain
    resume still runs. The new text is encoded with the run's tokenizer, never a rebuilt one."""
    run = tmp_path / "run"
    base = ["train", "--preset", "tiny", "--run-dir", str(run), "--quiet", "--data.cache_dir", str(tmp_path / "c")]
    # The run to resume, trained in this process (the resumes below are the commands under test).
    train(tiny(corpus_file, tmp_path / "c", **{"data.tokenizer": "char", "train.steps": "2"}), run, progress=False)
    kept = {name: (run / name).read_bytes() for name in ("config.json", "tokenizer.json")}
    other = tmp_path / "other.txt"
    other.write_text(corpus_file.read_text() + "QXZ!\n")
    reshaped, new_text = moekit_clis(  # two separate commands, started side by side
        [*base, "--resume", "--model.n_layers", "5", "--train.steps", "4"],
        [*base, "--resume", "--data", str(other), "--train.steps", "4"],
    )
    assert reshaped.returncode == 2 and "does not fit" in reshaped.stderr, reshaped.stderr
    assert new_text.returncode == 2 and "'Q'" in new_text.stderr, new_text.stderr  # not in the run's alphabet
    assert {name: (run / name).read_bytes() for name in kept} == kept
    again = moekit_cli(*base, "--resume", "--train.steps", "3")
    assert again.returncode == 0, again.stderr
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 3  # written once it resumed


def _optimizer_settings(run: Path) -> list[tuple[float, tuple[float, float]]]:
    """(weight decay, betas) of each optimizer group in the run's latest checkpoint, as saved."""
    from moekit.run.sharded import read_metadata, read_tensors

    sharded = latest_checkpoint(run) / "sharded"
    keys = [k for k in read_metadata(sharded).state_dict_metadata if k.startswith("optim.param_groups.")]
    state = {k: None for k in keys if k.endswith((".weight_decay", ".betas")) and "decoupled" not in k}
    read_tensors(sharded, state)
    groups = sorted({k.split(".")[2] for k in state})
    return [
        (state[f"optim.param_groups.{g}.weight_decay"], tuple(state[f"optim.param_groups.{g}.betas"])) for g in groups
    ]


@pytest.mark.slow
def test_settings_changed_on_resume_take_effect(corpus_file: Path, tmp_path: Path) -> None:
    """--train.weight_decay and --train.beta1 given to a resume are what its optimizer runs with (the
    checkpoint brings the moments, not the old settings) and what config.json records; a longer
    --train.steps continues on the cosine over the new total from the resumed step."""
    from moekit import runconfig
    from moekit.train.optim import lr_at

    run, plain = tmp_path / "run", tmp_path / "plain"
    base = ["train", "--preset", "tiny", "--data", str(corpus_file), "--quiet", "--resume", "--train.steps", "4"]
    # The run to resume, trained in this process (the resumes below are the commands under test).
    train(tiny(corpus_file, tmp_path / "c", **{"train.steps": "2", "train.sample_tokens": "0"}), run, progress=False)
    shutil.copytree(run, plain)
    changed, kept = moekit_clis(  # two separate runs, started side by side, each with its own token cache
        [*base, "--run-dir", str(run), "--data.cache_dir", str(tmp_path / "c")]
        + ["--train.weight_decay", "10", "--train.beta1", "0"],
        [*base, "--run-dir", str(plain), "--data.cache_dir", str(tmp_path / "c-plain")],
    )
    assert changed.returncode == 0 and kept.returncode == 0, changed.stderr + kept.stderr
    assert sorted(_optimizer_settings(run)) == [(0.0, (0.0, 0.95)), (10.0, (0.0, 0.95))]  # no decay on biases, norms
    assert sorted(_optimizer_settings(plain)) == [(0.0, (0.9, 0.95)), (0.1, (0.9, 0.95))]
    cfg = runconfig.from_json(run / "config.json")
    assert (cfg.train.weight_decay, cfg.train.beta1, cfg.train.steps) == (10.0, 0.0, 4)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    other = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines()]
    # Step 3's loss is taken before its update, from the same weights; step 4's follows another update.
    assert records[2]["loss"] == other[2]["loss"] and records[3]["loss"] != other[3]["loss"]
    before = runconfig.from_json(plain / "config.json")  # steps 4 too; the first two steps ran with 2
    first_two = [lr_at(s, dataclasses.replace(before.train, steps=2)) for s in range(2)]
    assert [r["lr"] for r in records] == first_two + [lr_at(s, cfg.train) for s in (2, 3)]
